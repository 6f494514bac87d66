"""Built-in domains against independent solvers, verifiers, JSONL errors with file:line, and the
grain prompt stream: disjoint across hosts, exactly resumable."""

import json
import re

import numpy as np
import pytest

from opd_jax.config import load_config
from opd_jax.data import (
    DOMAINS,
    DataError,
    ProceduralSource,
    eval_prompts,
    read_jsonl,
    source_domains,
    take,
    train_prompts,
    validation_prompts,
)
from opd_jax.envs.calculator import CalculatorEnv
from opd_jax.envs.gridworld import GridworldEnv
from opd_jax.envs.search import SearchEnv
from opd_jax.rewards import VERIFIERS, compute_rewards, exact_match, load_reward_fn, numeric_match


def solve(domain, prompt):
    """Each domain's answer recomputed from the prompt text alone."""
    body = prompt.split(" ", 1)[1][:-1] if " " in prompt else prompt[:-1]
    if domain in ("addition", "multiplication"):
        a, b = map(int, re.split(r"[+*]", prompt[:-1]))
        return str(a + b if "+" in prompt else a * b)
    if domain == "reverse":
        return body[::-1]
    if domain == "sort":
        return " ".join(sorted(body.split()))
    if domain == "count":
        letter, _, s = body.split(" ")
        return str(s.count(letter))
    if domain == "parity":
        return ["even", "odd"][body.count("1") % 2]
    if domain == "max":
        return str(max(map(int, body.split())))
    if domain == "copy_edit":
        s, _, edit = body.split(" ")
        old, new = edit.split("->")
        return s.replace(old, new)
    if domain == "chain":
        tokens = re.findall(r"[+\-*]|\d+", body)
        value = int(tokens[0])
        for op, x in zip(tokens[1::2], map(int, tokens[2::2])):
            value = {"+": value + x, "-": value - x, "*": value * x}[op]
        return str(value)
    if domain == "long_count":
        a, _, b = body.split(" ")
        return " ".join(map(str, range(int(a), int(b) + 1)))
    if domain == "word_problems":
        a, b = map(int, re.findall(r"\d+", prompt))
        return str(a + b if "more" in prompt else a - b if "away" in prompt else a * b)
    raise AssertionError(domain)


@pytest.mark.parametrize("name", DOMAINS)
def test_domains_are_correct_deterministic_and_verifiable(name):
    assert len(DOMAINS) >= 10
    source = ProceduralSource(name, seed=3)
    again = ProceduralSource(name, seed=3)
    held_out = ProceduralSource(name, seed=3, split="eval")
    verify = VERIFIERS[DOMAINS[name].verifier]
    prompts = set()
    for i in range(40):
        example = source[i]
        assert example == again[i] and example.domain == name
        assert example.answer == solve(name, example.prompt), example
        assert verify(example.answer, example.answer) == 1.0
        assert verify(example.answer + "7", example.answer) == 0.0
        prompts.add(example.prompt)
    assert len(prompts) > 20  # not a constant stream
    assert [held_out[i] for i in range(5)] != [source[i] for i in range(5)]


def test_verifiers():
    assert exact_match(" 42 \nand more", "42") == 1.0 and exact_match("420", "42") == 0.0
    assert numeric_match("She has 1,234 apples, so the answer is 12.", "12") == 1.0
    assert numeric_match("no number here", "12") == 0.0 and numeric_match("-3", "-3") == 1.0
    assert load_reward_fn("opd_jax.rewards:exact_match") is exact_match
    with pytest.raises(ValueError, match="must be given as 'module:function'"):
        load_reward_fn("opd_jax.rewards.exact_match")
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        load_reward_fn("no_such_module:f")
    with pytest.raises(ValueError, match="has no callable 'nope'"):
        load_reward_fn("opd_jax.rewards:nope")


def test_jsonl_reads_prompts_messages_and_names_bad_lines(tmp_path):
    good = tmp_path / "math.jsonl"
    good.write_text("\n".join([
        json.dumps({"prompt": "1+1=", "answer": 2}),
        "",
        json.dumps({"messages": [{"role": "user", "content": "2+2?"}], "answer": "4", "domain": "arith"}),
    ]) + "\n")
    examples = read_jsonl(good)
    assert [(e.prompt, e.answer, e.domain) for e in examples] == [("1+1=", "2", "math"), (None, "4", "arith")]
    assert examples[1].messages == ({"role": "user", "content": "2+2?"},) and examples[1].uid == "math.jsonl:3"
    cases = {
        '{"prompt": "x", "answer": 1}\n{"prompt": "y", answer: 2}\n':  # the text where the parser stopped
            r"""bad.jsonl:2: not valid JSON \(Expecting property name enclosed in double quotes at column 17: """
            r"""'\{"prompt": "y", answer: 2\}'\)""",
        '{"prompt": "x"}\n': r'bad.jsonl:1: missing "answer"',
        '{"prompt": "2+2=", "answer": "4"\n':  # a line cut short of its closing brace
            r"bad.jsonl:1: not valid JSON \(the line ends before its JSON does: Expecting ',' delimiter; a closing brace",
        '{"prompt": "x", "messages": [], "answer": 1}\n': r'bad.jsonl:1: needs exactly one of "prompt" and "messages"',
        '[1, 2]\n': r"bad.jsonl:1: each line must be a JSON object",
        '{"messages": [{"role": "user"}], "answer": 1}\n': r'bad.jsonl:1: "messages" must be a non-empty list',
        '{"prompt": "x", "answer": true}\n': r'bad.jsonl:1: "answer" must be a string or a number',
        '\n\n': r"bad.jsonl: holds no examples",
    }
    for text, message in cases.items():
        bad = tmp_path / "bad.jsonl"
        bad.write_text(text)
        with pytest.raises(DataError, match=message):
            read_jsonl(bad)
    with pytest.raises(DataError, match="no such prompt file"):
        read_jsonl(tmp_path / "missing.jsonl")
    bom = tmp_path / "bom.jsonl"  # as Windows editors save UTF-8
    bom.write_bytes(b'\xef\xbb\xbf{"prompt": "1+1=", "answer": 2}\n')
    assert [(e.prompt, e.answer) for e in read_jsonl(bom)] == [("1+1=", "2")]


def config_with(tmp_path):
    path = tmp_path / "extra.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": i}) + "\n" for i in range(30)))
    return load_config(None, [f"data.train=[{{builtin: addition}}, {{builtin: sort, weight: 2}}, {{jsonl: {path}}}]"])


def test_hosts_get_disjoint_prompts_covering_the_stream(tmp_path):
    data = config_with(tmp_path).data
    whole = [e.uid for e in take(iter(train_prompts(data)), 60)]
    host0 = [e.uid for e in take(iter(train_prompts(data, process_index=0, process_count=2)), 30)]
    host1 = [e.uid for e in take(iter(train_prompts(data, process_index=1, process_count=2)), 30)]
    assert host0 == whole[0::2] and host1 == whole[1::2]
    # the JSONL file's 30 lines repeat every epoch, so uids recur; within one pass they are disjoint
    assert not {u for u in host0 if "/" in u} & {u for u in host1 if "/" in u}
    domains = {uid.split("/")[0].split(":")[0] for uid in whole}
    assert domains == {"addition", "sort", "extra.jsonl"}
    with pytest.raises(ValueError, match="process_index 2 is not in"):
        train_prompts(data, process_index=2, process_count=2)


def test_resumed_iterator_yields_what_an_uninterrupted_one_would(tmp_path):
    data = config_with(tmp_path).data
    straight = iter(train_prompts(data))
    expected = take(straight, 25)
    first = iter(train_prompts(data))
    take(first, 11)
    state = json.loads(json.dumps(first.get_state()))  # what a checkpoint stores
    resumed = iter(train_prompts(data))
    resumed.set_state(state)
    assert take(resumed, 14) == expected[11:]


def test_eval_prompts_are_fixed_and_held_out(tmp_path):
    data = load_config(None, ["data.train=[{builtin: addition}, {builtin: parity}]",
                              "data.eval_prompts_per_domain=16"]).data
    held_out = eval_prompts(data)
    assert set(held_out) == {"addition", "parity"} and all(len(v) == 16 for v in held_out.values())
    assert held_out == eval_prompts(data)
    train_uids = {e.uid for e in take(iter(train_prompts(data)), 200)}
    assert not train_uids & {e.uid for v in held_out.values() for e in v}
    rng_prompts = {e.prompt for e in take(iter(train_prompts(data)), 200)}
    assert np.mean([e.prompt in rng_prompts for e in held_out["addition"]]) < 0.5


def test_a_domains_held_out_and_validation_prompts_do_not_depend_on_the_mix():
    """An expert trained on one domain and a merge over many evaluate it on the same prompts;
    validation prompts (for choosing a merge scale) are apart from the held-out ones."""
    mixed = load_config(None, ["data.train=[{builtin: sort}, {builtin: parity}, {builtin: addition}]"]).data
    alone = load_config(None, ["data.train=[{builtin: parity}]"]).data
    assert eval_prompts(mixed)["parity"] == eval_prompts(alone)["parity"]
    assert validation_prompts(mixed, 8)["parity"] == validation_prompts(alone, 8)["parity"]
    held_out = {e.prompt for e in eval_prompts(mixed)["addition"]}
    validation = [e.prompt for e in validation_prompts(mixed, 32)["addition"]]
    assert not held_out & set(validation)
    assert source_domains(mixed.train[1]) == {"parity"}


def _content(example):
    """An example's problem, recomputed from what it is (the prompt text; an episode's secret,
    map or problem text read off the environment it builds), not through the split's own keys."""
    if example.episode is None:
        return example.prompt
    spec = example.episode
    env = {"search": SearchEnv, "gridworld": GridworldEnv, "calculator": CalculatorEnv}[spec.environment](
        spec.seed, spec.split, **spec.params)
    if spec.environment == "search":
        return ("search", env.secret)
    if spec.environment == "gridworld":
        return ("gridworld", env.wall.tobytes(), env.pos, env.goal)
    return ("calculator", env.problem)


# every built-in domain at parameters whose problem space is small (the case where a held-out
# draw could land on a training problem), and every built-in environment
_SMALL = {"addition": {"digits": 1}, "multiplication": {"digits": 1}, "reverse": {"min_len": 2, "max_len": 3},
          "sort": {"min_len": 2, "max_len": 3}, "count": {"min_len": 2, "max_len": 5}, "parity": {"min_len": 2, "max_len": 5},
          "max": {"min_len": 2, "max_len": 2, "hi": 9}, "copy_edit": {"min_len": 2, "max_len": 2},
          "chain": {"steps": 1, "hi": 4}, "long_count": {"min_span": 2, "max_span": 4, "hi": 20},
          "word_problems": {"hi": 3}}
_SOURCES = ([f"{{builtin: {name}, params: {json.dumps(params)}}}" for name, params in _SMALL.items()]
            + ["{environment: search, params: {hi: 31}}", "{environment: gridworld, params: {size: 4}}",
               "{environment: calculator}"])


@pytest.mark.parametrize("source", _SOURCES)
def test_no_held_out_problem_is_ever_trained_on_or_validated_on(source):
    """Over several data seeds: the held-out problems are distinct, and none of them is in the
    training stream (the RL stream and the warm start's), the validation draw or the teachers'
    samples, over many draws; the training stream does reach the rest of a small space."""
    assert set(_SMALL) == set(DOMAINS)
    for seed in (0, 1, 7):
        data = load_config(None, [f"data.train=[{source}]", "data.eval_prompts_per_domain=5", f"data.seed={seed}"]).data
        (held_out,) = eval_prompts(data).values()
        held = [_content(e) for e in held_out]
        assert len(set(held)) == len(held) == 5
        trained = {_content(e) for e in take(iter(train_prompts(data)), 600)}
        trained |= {_content(e) for e in take(iter(train_prompts(data, seed_offset=7919)), 200)}
        validation = {_content(e) for draw in ("validation", "teacher_samples")
                      for e in next(iter(validation_prompts(data, 100, draw=draw).values()))}
        assert not set(held) & (trained | validation), source


def test_a_small_problem_space_is_split_exactly_and_a_split_it_cannot_give_is_refused():
    """One-digit addition: 100 problems, a quarter held out, exactly, whatever the seed; training
    reaches every other one. Asking for more held-out problems than the quarter holds is one
    error naming the domain and its size."""
    for seed in range(4):
        data = load_config(None, ["data.train=[{builtin: addition, params: {digits: 1}}]", f"data.seed={seed}",
                                  "data.eval_prompts_per_domain=25"]).data
        held = {e.prompt for e in eval_prompts(data)["addition"]}
        trained = {e.prompt for e in take(iter(train_prompts(data)), 3000)}
        assert len(held) == 25 and len(trained) == 75 and not held & trained
    other = load_config(None, ["data.train=[{builtin: addition, params: {digits: 1}}]", "data.seed=1",
                               "data.eval_prompts_per_domain=25"]).data
    assert {e.prompt for e in eval_prompts(other)["addition"]} != held  # another seed, another quarter
    data = load_config(None, ["data.train=[{builtin: parity, params: {min_len: 2, max_len: 4}, eval_prompts: 8}]"]).data
    with pytest.raises(DataError, match=r"^data.train\[0\] \(parity .*\): 8 held-out problems asked for, but its problem "
                       r"space of 28 problems holds only 7 in its held-out share \(0.25\)"):
        eval_prompts(data)
    data = load_config(None, ["data.train=[{environment: search, params: {hi: 15}}]", "data.held_out_share=0.5",
                              "data.eval_prompts_per_domain=9"]).data
    with pytest.raises(DataError, match=r"environment search .* space of 16 problems holds only 8"):
        eval_prompts(data)


@pytest.mark.parametrize("name", DOMAINS)
def test_a_domains_problem_space_is_what_it_draws(name):
    """The size docs/config.md and the refusal give, against the distinct prompts of many draws."""
    source = ProceduralSource(name, params=_SMALL[name])
    rng = np.random.default_rng(0)
    drawn = {source.sample(rng)[0] for _ in range(60 * source.space)}
    assert len(drawn) == source.space, name


def test_held_out_jsonl_prompts_that_are_also_training_prompts_are_warned_of(tmp_path, capsys):
    from opd_jax.train.preflight import check_data

    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}", "answer": i}) + "\n" for i in range(5)))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps({"prompt": f"q{i}", "answer": i}) + "\n" for i in (3, 9)))
    data = load_config(None, [f"data.train=[{{jsonl: {tmp_path / 'train.jsonl'}, eval_jsonl: {tmp_path / 'eval.jsonl'}}}]"]).data
    check_data(data, None, None, 8)
    assert ("warning: data.train[0]: 1 of the 2 held-out prompts (eval.jsonl:1 first) are also training prompts"
            in capsys.readouterr().err)


def test_a_math_source_is_judged_by_math_verify(tmp_path):
    """GSM8K-style lines with verifier: math; boxed LaTeX, fractions and plain numbers compare as
    values (math-verify's own judgement is the reference, checked on cases it documents)."""
    path = tmp_path / "gsm.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "Half of 1?", "answer": "\\frac{1}{2}"}, {"prompt": "Apples?", "answer": "1000"},
        {"prompt": "Root?", "answer": "\\sqrt{2}"}]) + "\n")
    config = load_config(None, [f"data.train=[{{jsonl: {path}, verifier: math}}]"])
    examples = sorted(take(iter(train_prompts(config.data)), 3), key=lambda e: e.uid)
    responses = ["so it is $\\boxed{0.5}$", "We get 1,000 apples.", "x = \\boxed{\\sqrt{3}}"]
    np.testing.assert_array_equal(compute_rewards(responses, examples), [1.0, 1.0, 0.0])
    # without it, the numeric verifier cannot read LaTeX
    plain = load_config(None, [f"data.train=[{{jsonl: {path}}}]"])
    examples = sorted(take(iter(train_prompts(plain.data)), 3), key=lambda e: e.uid)
    assert compute_rewards(responses, examples)[0] == 0.0
    with pytest.raises(Exception, match="verifier applies to JSONL sources"):
        load_config(None, ["data.train=[{builtin: addition, verifier: math}]"])
