"""A text gridworld: walk from the start to the goal one move at a time, seeing only where you
are, where the goal is and which of the four neighbouring cells are open.

    at 0,3 goal 4,1 open SE     (row, column; N is row - 1, E is column + 1)
    S                           (the model's turn: one of N S E W)
    at 1,3 goal 4,1 open NSW
    ...

Reward 1 on reaching the goal within `max_moves`, 0 otherwise; a move into a wall or off the grid
(or an answer that is not a direction) uses a move and leaves you where you were. Walls are
random with a path from start to goal guaranteed; the start is at least `min_distance` moves
away. At the default size a shortest path is 6-10 moves, and an episode 6-24 turns of about 25
tokens each.
"""

from __future__ import annotations

import collections

import numpy as np

from opd_jax.envs.protocol import StepResult, Turn

SPLITS = {"train": 0, "eval": 1}
MOVES = {"N": (-1, 0), "S": (1, 0), "E": (0, 1), "W": (0, -1)}


class GridworldEnv:
    name = "gridworld"

    def __init__(self, seed: int, split: str = "train", size: int = 6, walls: float = 0.2, max_moves: int = 24,
                 min_distance: int = 6):
        if size < 3 or not 0 <= walls < 0.5 or max_moves < 1:
            raise ValueError(f"gridworld needs size >= 3, 0 <= walls < 0.5 and max_moves >= 1, got size={size}, "
                             f"walls={walls}, max_moves={max_moves}")
        rng = np.random.default_rng([seed, SPLITS[split]])
        self.size, self.max_moves, self.moves = size, max_moves, 0
        while True:  # redraw until the goal is reachable and far enough
            self.wall = rng.random((size, size)) < walls
            cells = [(r, c) for r in range(size) for c in range(size) if not self.wall[r, c]]
            if len(cells) < 2:
                continue
            i, j = rng.choice(len(cells), 2, replace=False)
            self.pos, self.goal = cells[i], cells[j]
            distance = self._distances().get(self.pos)
            if distance is not None and distance >= min(min_distance, 2 * size - 2):
                break

    @staticmethod
    def problem_space(size: int = 6, **_: object) -> int:
        """An upper bound on distinct episodes: every wall pattern with every start and goal."""
        return 2 ** (size * size) * (size * size) ** 2

    def problem_key(self) -> str:
        """The episode's content (held-out splits keep equal ones apart): its map, start and goal."""
        walls = "".join("#" if w else "." for w in self.wall.ravel())
        return f"{self.size}x{self.size} {walls} from {self.pos} to {self.goal}"

    def _open(self, cell: tuple[int, int]) -> str:
        r, c = cell
        return "".join(d for d, (dr, dc) in MOVES.items()
                       if 0 <= r + dr < self.size and 0 <= c + dc < self.size and not self.wall[r + dr, c + dc])

    def _distances(self) -> dict[tuple[int, int], int]:
        """Moves from each reachable cell to the goal (breadth-first from the goal)."""
        distance = {self.goal: 0}
        queue = collections.deque([self.goal])
        while queue:
            r, c = queue.popleft()
            for d in self._open((r, c)):
                dr, dc = MOVES[d]
                if (r + dr, c + dc) not in distance:
                    distance[(r + dr, c + dc)] = distance[(r, c)] + 1
                    queue.append((r + dr, c + dc))
        return distance

    def _observation(self) -> str:
        return f"at {self.pos[0]},{self.pos[1]} goal {self.goal[0]},{self.goal[1]} open {self._open(self.pos)}\n"

    def reset(self) -> str:
        return self._observation()

    def step(self, turn: Turn) -> StepResult:
        self.moves += 1
        move = turn.text.strip().upper()
        if move in MOVES and move in self._open(self.pos):
            self.pos = (self.pos[0] + MOVES[move][0], self.pos[1] + MOVES[move][1])
        if self.pos == self.goal:
            return StepResult(reward=1.0, done=True, info={"success": True, "moves": self.moves})
        if self.moves >= self.max_moves:
            return StepResult(done=True, info={"success": False, "moves": self.moves})
        return StepResult(observation=self._observation())

    def expert(self) -> str:
        """A move along a shortest path."""
        distance = self._distances()
        r, c = self.pos
        return min(self._open(self.pos), key=lambda d: distance.get((r + MOVES[d][0], c + MOVES[d][1]), 10**9))
