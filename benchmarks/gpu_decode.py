"""Decode tokens/s of the engine vs HF transformers on the same GPU, at 1, 8 and 32 streams. JSON out.

    python -P benchmarks/gpu_decode.py [--device cuda] [--streams 1,8,32] [--shape smollm2-135m|llama-1b]

Random weights of a Llama shape (no download: a GPU machine here reaches no hub), the same weights in
both: the engine in bf16 (flex attention over the paged pool; `--cuda-graphs` replays decode steps from
CUDA graphs) and transformers' LlamaForCausalLM in bf16 with its static-free default cache, greedy,
`--decode-tokens` tokens per stream after a short prompt. Ratios are taken inside this one run.
`--device cpu --shape tiny` is the smoke run the CPU machine can do (scripts/gpu_check.sh runs the rest).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 512},
    "smollm2-135m": {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                     "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152},
    "llama-1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                 "num_key_value_heads": 8, "vocab_size": 128256},
}


def word_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer over the model's vocabulary: prompts go in as ids; text is not measured."""
    import tokenizers

    from decodeservice.engine.tokenizer import Tokenizer

    vocab = {f"w{i}": i for i in range(vocab_size)}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab=vocab, unk_token="w0"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend=backend, bos_token=None, eos_tokens=["w1"], chat_template=None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="smollm2-135m", choices=list(SHAPES))
    parser.add_argument("--streams", default="1,8,32")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--cuda-graphs", action="store_true")
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    from decodeservice.engine import Engine, EngineConfig, SamplingParams
    from decodeservice.engine.engine import build_model
    from decodeservice.engine.loader.hf_loader import _config

    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    hf_config = LlamaConfig(**SHAPES[args.shape], max_position_embeddings=4096, tie_word_embeddings=True,
                            rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=1)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_config).to(dtype=dtype).eval()
    weights = {name: t.detach().float() for name, t in hf.state_dict().items() if name != "lm_head.weight"}
    hf = hf.to(args.device)
    tokenizer = word_tokenizer(hf_config.vocab_size)
    cfg = _config(hf_config.to_dict(), tokenizer, path=Path("."))
    engine_config = EngineConfig(device=args.device, kv_cache_gib=2.0 if args.device.startswith("cuda") else 0.05,
                                 cuda_graphs=args.cuda_graphs, max_model_len=1024)
    engine = Engine(model=build_model(cfg, weights, engine_config), tokenizer=tokenizer, config=engine_config)
    greedy = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
    rows: list[dict[str, Any]] = []
    for streams in (int(s) for s in args.streams.split(",")):
        prompts = torch.randint(2, hf_config.vocab_size, (streams, args.prompt_tokens),
                                generator=torch.Generator().manual_seed(streams))
        engine.generate([p.tolist() for p in prompts[:1]], SamplingParams(max_tokens=4))  # warm
        start = time.perf_counter()
        engine.generate([p.tolist() for p in prompts], greedy)
        _sync(args.device)
        ours = streams * args.decode_tokens / (time.perf_counter() - start)
        with torch.inference_mode():
            ids = prompts.to(args.device)
            hf.generate(ids[:, :8], max_new_tokens=4, do_sample=False)  # warm
            start = time.perf_counter()
            hf.generate(ids, max_new_tokens=args.decode_tokens, min_new_tokens=args.decode_tokens, do_sample=False)
            _sync(args.device)
            theirs = streams * args.decode_tokens / (time.perf_counter() - start)
        rows.append({"streams": streams, "engine_tokens_per_s": round(ours, 1), "hf_tokens_per_s": round(theirs, 1),
                     "ratio": round(ours / theirs, 3)})
        print(json.dumps(rows[-1]), file=sys.stderr)
    print(json.dumps({"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
                      "torch": torch.__version__, "shape": args.shape, "cuda_graphs": args.cuda_graphs,
                      "decode_tokens": args.decode_tokens, "rows": rows}, indent=1))
    return 0


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


if __name__ == "__main__":
    raise SystemExit(main())
