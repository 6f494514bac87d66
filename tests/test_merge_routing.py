"""OPD routing: every prompt is scored by its own domain's teacher (teachers that differ), and
teachers that cannot score the student's tokens are refused before training."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
import tokenizers.models
from flax import nnx
from ppo_setup import TINY

from opd_jax.core import select_teacher, token_logprobs
from opd_jax.merge import RoutingError, check_teacher_compatible, routing_table, teacher_indices
from opd_jax.models import Decoder
from opd_jax.models.char_tokenizer import char_tokenizer


def test_each_row_is_scored_by_its_domains_teacher():
    teachers = ["addition", "max", "parity"]
    models = [Decoder(TINY, rngs=nnx.Rngs(seed)) for seed in range(3)]
    domains = ["max", "parity", "addition", "max", "addition"]
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, TINY.vocab_size, (5, 9)), jnp.int32)
    per_teacher = jnp.stack([token_logprobs(m(tokens), tokens)[0] for m in models])
    assert not np.allclose(per_teacher[0], per_teacher[1])  # the teachers really differ
    routes = routing_table({name: [name] for name in teachers})
    routed = select_teacher(per_teacher, jnp.asarray(teacher_indices(domains, routes)))
    for row, domain in enumerate(domains):
        alone = token_logprobs(models[teachers.index(domain)](tokens[row:row + 1]), tokens[row:row + 1])[0][0]
        np.testing.assert_allclose(routed[row], alone, atol=1e-5)


def test_routing_table_and_a_domain_without_a_teacher():
    routes = routing_table({"arith": ["addition", "multiplication"], "lists": ["sort", "max"]})
    assert list(teacher_indices(["sort", "addition", "max", "multiplication"], routes)) == [1, 0, 1, 0]
    with pytest.raises(RoutingError, match="no teacher for domain\\(s\\) chain, parity; the teachers cover: addition"):
        teacher_indices(["addition", "parity", "chain", "parity"], routes)
    with pytest.raises(RoutingError, match="domain 'max' has two teachers: 'lists' and 'max'"):
        routing_table({"lists": ["sort", "max"], "max": ["max"]})


def test_teachers_with_another_vocabulary_or_tokenizer_are_refused():
    student = char_tokenizer()
    check_teacher_compatible("same", 99, char_tokenizer(), 99, student)
    with pytest.raises(RoutingError, match="vocabulary of 100 tokens, the student 99"):
        check_teacher_compatible("big", 100, char_tokenizer(), 99, student)
    with pytest.raises(RoutingError, match="no tokenizer"):
        check_teacher_compatible("bare", 99, None, 99, student)
    vocab = student.backend.get_vocab()
    swapped = {**vocab, "1": vocab["2"], "2": vocab["1"]}
    other = tokenizers.Tokenizer(tokenizers.models.WordLevel(swapped, unk_token="<unk>"))
    other.pre_tokenizer, other.decoder = student.backend.pre_tokenizer, student.backend.decoder
    with pytest.raises(RoutingError, match="maps 2 of the student's tokens to other ids"):
        check_teacher_compatible("swapped", 99, dataclasses.replace(student, backend=other), 99, student)
