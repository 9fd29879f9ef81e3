"""A tiny random Llama with a real byte-level BPE tokenizer and chat template, and the
outputs the engines produce offline on it: the references the served text must equal.

The checkpoint is random, so its logits are nearly flat; the LM head is scaled up (as in
``tests/engine/tiny_checkpoints.py``) so greedy choices lead by a wide margin and batch
composition or a prefix-cache hit cannot flip a token through rounding noise.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from common.tokenizer import BaseTokenizer
from tests.engine.test_tokenizer import EOS, EOT, PAD, train_byte_bpe, write_hf_folder
from workers.engine.outputs import RequestOutput
from workers.engine.sampling_params import SamplingParams
from workers.sim import SimCost, SimEngine

MAX_POSITIONS = 512


def save_tiny_llama(folder: Path) -> Path:
    """Write a 2-layer Llama (fp32 safetensors) plus tokenizer files into ``folder``."""
    import transformers as tf

    bpe = train_byte_bpe()  # deterministic: the same vocabulary write_hf_folder saves
    torch.manual_seed(4321)
    config = tf.LlamaConfig(
        vocab_size=bpe.get_vocab_size(),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=0,
        eos_token_id=bpe.token_to_id(EOS),
        pad_token_id=bpe.token_to_id(PAD),
        initializer_range=0.2,
    )
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)  # clear greedy margins
    model.save_pretrained(folder, safe_serialization=True)
    # After the model: its generation_config.json would otherwise replace the folder's,
    # which stops on <|eot|> as well as <|end|>.
    write_hf_folder(folder)
    assert bpe.token_to_id(EOT) is not None
    return folder


def sim_reference(
    tokenizer: BaseTokenizer, prompt_token_ids: list[int], params: SamplingParams
) -> RequestOutput:
    """What a ``--engine sim`` worker with this tokenizer generates, computed in-process."""
    engine = SimEngine(
        max_seq_len=MAX_POSITIONS,
        cost=SimCost(base_s=0.0, prefill_s_per_token=0.0, decode_s_per_seq=0.0),
        tokenizer=tokenizer,
    )
    engine.add_request("ref", None, params, prompt_token_ids=list(prompt_token_ids))
    while True:
        for delta in engine.step():
            if delta.output is not None:
                return delta.output


def joined(chunks: list[Any]) -> str:
    """The text of an openai client's streamed completion or chat chunks."""
    parts = []
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = getattr(choice, "delta", None)
        parts.append((delta.content if delta is not None else choice.text) or "")
    return "".join(parts)
