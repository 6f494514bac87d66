"""The XLA flags of every JAX process the suite runs: its own workers and the processes they start.

The suite's programs are tiny and run a few steps, so compiling them is most of their time: LLVM at
-O0 compiles a tiny run's programs about 1.6x faster and runs them about 1.5x slower (19 steps of
the quickstart at test size: compiles 13.8 -> 8.9 s, steps 1.8 -> 2.8 s; tests/test_ppo_step.py
275 -> 183 s; the search game's learning test 168 -> 157 s). The HLO passes are the same at every
level; LLVM's own passes (vectorised reductions, say) may order float arithmetic differently, so a
figure can differ in its last bits from a user's run, never by more than the tests' tolerances
allow (the whole suite passes at -O0). A process that runs many steps is better at the default
level (the merge notebook's 600 steps: 228 s at -O2, 296 s at -O0).
"""

OPTIMIZATION = "--xla_backend_optimization_level=0"


def xla_flags(devices: int, many_steps: bool = False) -> str:
    """XLA_FLAGS for a process with `devices` simulated CPU devices (`many_steps`: at XLA's default
    optimization level)."""
    return f"--xla_force_host_platform_device_count={devices}" + ("" if many_steps else f" {OPTIMIZATION}")
