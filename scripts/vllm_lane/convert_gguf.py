"""Write a GGUF model as a Hugging Face folder vLLM's CPU build can load (it reads no GGUF).

Run by scripts/vllm_lane.sh with the vLLM venv's interpreter (transformers and gguf live there):

    python convert_gguf.py MODEL.gguf OUT_DIR

transformers dequantizes the GGUF's weights as it loads them; a model loaded that way refuses
`save_pretrained`, so its weights are copied into a fresh model of the same config first. The tokenizer
(with its chat template) comes from the same file. OUT_DIR is written through a temporary folder and
renamed at the end, so a folder that exists is complete.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def main(gguf: Path, out: Path) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    kwargs = {"gguf_file": gguf.name}
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), **kwargs)
    config = AutoConfig.from_pretrained(str(gguf.parent), **kwargs)
    fresh = AutoModelForCausalLM.from_config(config, dtype=loaded.dtype)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    if unexpected or [k for k in missing if "lm_head" not in k]:
        raise SystemExit(f"{gguf}: weights do not match the config (missing {missing}, unexpected {unexpected})")
    if config.tie_word_embeddings:
        fresh.tie_weights()
    fresh.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    print(f"{out}: {sum(p.numel() for p in fresh.parameters())} parameters", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit("usage: convert_gguf.py MODEL.gguf OUT_DIR")
    raise SystemExit(main(Path(sys.argv[1]), Path(sys.argv[2])))
