"""Observations into token ids, appended after the model's own tokens, never re-encoding them.

Decoding a turn and encoding the whole conversation again is not the identity for BPE
tokenizers (" 12" may come back as " 1" "2", a different sequence of different log-probs), so a
trajectory is built by appending: the engine's ids as they came, then the ids of what follows
them. With a chat template, what follows a model turn is the template's close of the assistant
message (less the stop token the model already produced) and the observation's messages with the
next assistant header; both are found by rendering a fixed conversation with and without them,
so any Jinja chat template works. Without one (the character models), the observation's text is
encoded as it is, after the model's stop token (added when the turn was cut at its budget).
"""

from __future__ import annotations

from collections.abc import Sequence

from opd_jax.envs.protocol import EnvError, Message, Observation, check_observation
from opd_jax.models import Tokenizer

_MARK = "\x00OPD_JAX_TURN\x00"  # stands in for the assistant's text when rendering the template


class TurnCodec:
    """Token ids of a first observation and of what follows each model turn, for one tokenizer;
    `chat`: render message observations (and plain-text ones) with its chat template.
    `end_of_turn`: the stop token; without a chat template it separates a turn cut at its token
    budget from the observation after it (as the model's own stop token does)."""

    def __init__(self, tokenizer: Tokenizer, chat: bool, end_of_turn: int | None = None):
        self.tokenizer, self.chat, self.end_of_turn = tokenizer, chat, end_of_turn
        if chat:
            if not tokenizer.chat_template:
                raise EnvError("data.chat_template is on but the tokenizer has no chat template")
            base = [{"role": "user", "content": _MARK}, {"role": "assistant", "content": _MARK}]
            self._base = base
            closed = tokenizer.apply_chat_template(base, add_generation_prompt=False)
            if not closed.count(_MARK) == 2:
                raise EnvError("the chat template does not write message contents as they are")
            self._closed = closed
            # what the template writes after an assistant message's content
            self._close = closed[closed.rindex(_MARK) + len(_MARK):]

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False) if text else []

    def _messages(self, observation: Observation) -> list[Message] | None:
        if isinstance(observation, str):
            return [{"role": "user", "content": observation}] if self.chat else None
        if isinstance(observation[0], dict):
            if not self.chat:
                raise EnvError("the environment answers with chat messages, but data.chat_template is off")
            return [dict(m) for m in observation]
        return None

    def first(self, observation: Observation) -> list[int]:
        """The prompt of an episode: the first observation, with the assistant header to follow."""
        observation = check_observation(observation)
        messages = self._messages(observation)
        if messages is not None:
            return self.tokenizer.encode_chat(messages)
        if isinstance(observation, str):
            return self.tokenizer.encode(observation)
        return list(observation)

    def after_turn(self, turn_ids: Sequence[int], observation: Observation) -> list[int]:
        """The ids that follow a model turn (`turn_ids`, as the engine produced them) when the
        environment answers with `observation`: the close of the assistant message, then the
        observation and the next assistant header (chat), or the observation alone."""
        observation = check_observation(observation)
        messages = self._messages(observation)
        if messages is None:
            cut = self.end_of_turn is not None and (not turn_ids or turn_ids[-1] != self.end_of_turn)
            return [*([self.end_of_turn] if cut else []),
                    *(self._encode(observation) if isinstance(observation, str) else observation)]
        full = self.tokenizer.apply_chat_template([*self._base, *messages], add_generation_prompt=True)
        if not full.startswith(self._closed):
            raise EnvError("the chat template renders earlier messages differently once more follow; "
                           "return token ids from the environment instead")
        return [*self._close_ids(turn_ids), *self._encode(full[len(self._closed):])]

    def _close_ids(self, turn_ids: Sequence[int]) -> list[int]:
        """The template's close of the assistant message, less the part the model already wrote
        (its stop token, e.g. <|im_end|>)."""
        close = self._close
        if turn_ids:
            last = self.tokenizer.decode([turn_ids[-1]])
            if last and close.startswith(last):
                close = close[len(last):]
        return self._encode(close)
