"""`decodectl engine` flags: bad ones exit 2 with the reason, before anything loads or listens."""

from __future__ import annotations

import argparse

import pytest

from decodeservice.cli import engine_cmd
from decodeservice.cli.main import build_parser, main
from decodeservice.engine.config import SpeculativeConfig


@pytest.mark.parametrize(("flags", "message"), [
    (["--quantization", "int8", "--dtype", "float16"], "runs bfloat16 or float32 activations"),
    (["--quantization", "int4", "--device", "cuda"], "runs on CPU only"),
    (["--speculative-method", "draft"], "needs draft_model"),
    (["--speculative-method", "ngram", "--num-speculative-tokens", "99"], "num_tokens must be in [1, 16]"),
    (["--max-num-seqs", "0"], "max_num_seqs must be >= 1"),
    (["--kv-cache-gib", "-1"], "kv_cache_gib must be positive"),
    (["--max-body-bytes", "10"], "max_body_bytes must be at least 1024"),
    (["--port", "70000"], "is not a TCP port"),
    (["--model", "no-such-model"], "is not a known model"),
])
def test_bad_flags_exit_2(flags: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["engine", *flags])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("decodectl engine: error:") and message in err


def test_flags_map_to_engine_config() -> None:
    args = build_parser().parse_args([
        "engine", "--kv-cache-gib", "2", "--max-num-seqs", "8", "--speculative-method", "ngram",
        "--num-speculative-tokens", "3", "--speculative-disable-batch-size", "4", "--no-prefix-caching"])
    assert isinstance(args, argparse.Namespace)
    kwargs = engine_cmd.engine_kwargs(args)
    assert kwargs["kv_cache_gib"] == 2.0 and kwargs["max_num_seqs"] == 8
    assert kwargs["enable_prefix_caching"] is False and kwargs["quantization"] == "auto"
    # Every speculative option is passed (the unset ones at the config's defaults): the config they build
    # is the one asked for.
    assert SpeculativeConfig(**kwargs["speculative"]) == SpeculativeConfig(method="ngram", num_tokens=3,
                                                                            disable_batch_size=4)
    plain = engine_cmd.engine_kwargs(build_parser().parse_args(["engine"]))
    assert "speculative" not in plain


def test_draft_model_alone_asks_for_draft_speculation() -> None:
    kwargs = engine_cmd.engine_kwargs(build_parser().parse_args(["engine", "--draft-model", "d.gguf",
                                                                 "--no-prefix-caching"]))
    assert kwargs["speculative"]["method"] == "draft" and kwargs["speculative"]["draft_model"] == "d.gguf"
    assert kwargs["enable_prefix_caching"] is False
