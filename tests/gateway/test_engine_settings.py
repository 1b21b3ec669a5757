"""Engine settings reach the engine: `[engine]` keys of a config file and the serve/generate flags."""

from __future__ import annotations

import pytest

from gateway.cli.main import build_parser, main
from gateway.cli.serve_cmd import build_settings
from gateway.settings import GatewaySettings, read_config_file


def test_config_file_engine_keys_are_accepted_and_passed_to_the_engine(tmp_path, tiny_model_dir):
    cfg = tmp_path / "pg.toml"
    cfg.write_text(
        "[engine]\n"
        f'model = "{tiny_model_dir}"\n'
        'dtype = "bf16"\nkv_dtype = "int8"\nblock_size = 32\n'
        "max_num_batched_tokens = 512\nmax_num_seqs = 8\nthreads = 1\nprefill_graph_tokens = 256\n"
        "max_mixed_prefill_tokens = 64\nkv_page_layout = \"head\"\nwarm_up_kernels = false\n"
    )
    args = build_parser().parse_args(["serve", "--config", str(cfg)])
    engine = build_settings(args, tmp_path).engine_config()
    assert (engine.dtype, engine.kv_dtype, engine.block_size) == ("bfloat16", "int8", 32)
    assert (engine.max_num_batched_tokens, engine.max_num_seqs, engine.num_threads) == (512, 8, 1)
    assert engine.prefill_graph_tokens == 256
    assert engine.mixed_prefill_cap == 64
    assert engine.kv_page_layout == "head"
    assert engine.warm_up_kernels is False  # on by default (EngineConfig), off here
    assert engine.model_dir == tiny_model_dir


def test_the_mixed_prefill_cap_defaults_by_device_and_0_turns_it_off(tmp_path):
    """CPU steps of max_num_batched_tokens prefill take seconds: capped by default; CUDA keeps full steps."""
    from engine.config import CPU_MIXED_PREFILL_TOKENS, EngineConfig

    assert EngineConfig(model_dir=tmp_path).mixed_prefill_cap == CPU_MIXED_PREFILL_TOKENS
    assert EngineConfig(model_dir=tmp_path, device="cuda").mixed_prefill_cap is None
    assert EngineConfig(model_dir=tmp_path, max_mixed_prefill_tokens=0).mixed_prefill_cap is None
    assert EngineConfig(model_dir=tmp_path, device="cuda", max_mixed_prefill_tokens=512).mixed_prefill_cap == 512


def test_flags_override_the_config_file(tmp_path, tiny_model_dir):
    cfg = tmp_path / "pg.yaml"
    cfg.write_text(f"engine:\n  model: {tiny_model_dir}\n  kv_dtype: int8\n  threads: 4\n")
    args = build_parser().parse_args(["serve", "--config", str(cfg), "--kv-dtype", "fp8", "--threads", "2",
                                      "--dtype", "fp32"])
    engine = build_settings(args, tmp_path).engine_config()
    assert (engine.kv_dtype, engine.num_threads, engine.dtype) == ("fp8", 2, "float32")


@pytest.mark.parametrize("flags, message", [
    (["--kv-dtype", "fp4"], "--kv-dtype must be one of"),
    (["--dtype", "int8"], "--dtype must be one of"),
    (["--threads", "0"], "--threads must be >= 1"),
])
def test_bad_engine_flags_exit_2_with_one_line(tmp_path, capsys, flags, message):
    assert main(["serve", "--home", str(tmp_path), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert main(["generate", "--home", str(tmp_path), *flags, "hi"]) == 2
    assert message in capsys.readouterr().err


def test_bad_engine_keys_in_a_config_file_are_named(tmp_path):
    cfg = tmp_path / "pg.toml"
    cfg.write_text('[engine]\nkv_dtype = "fp4"\n')
    with pytest.raises(ValueError, match="kv_dtype"):
        GatewaySettings(**read_config_file(cfg))
    cfg.write_text("[engine]\nblock_size = 12\n")
    with pytest.raises(ValueError, match="block_size"):
        GatewaySettings(**read_config_file(cfg))
    cfg.write_text('[engine]\nkv_page_layout = "nhd"\n')
    with pytest.raises(ValueError, match="kv_page_layout"):
        GatewaySettings(**read_config_file(cfg))


@pytest.mark.parametrize("engine_keys, message", [
    ("max_num_batched_tokens = 8", "max_num_batched_tokens >= block_size"),
    ("prefill_graph_tokens = 1", "prefill_graph_tokens must be 0 (off) or >= 2"),
    ("max_mixed_prefill_tokens = -1", "max_mixed_prefill_tokens"),
    ("prepare_workers = 0", "prepare_workers"),
    ('max_body = "1MiB"', "max_body"),
])
def test_bad_engine_settings_are_reported_before_the_model_is_resolved(tmp_path, capsys, engine_keys, message):
    """A checkpoint that does not exist would be reported first if the model were resolved first; and
    without `model` (SmolLM2, converted under the home) nothing is converted before the error."""
    cfg = tmp_path / "pg.toml"
    for model_line in (f'model = "{tmp_path / "no-such-checkpoint"}"\n', ""):
        cfg.write_text(f"[engine]\n{model_line}{engine_keys}\n")
        assert main(["serve", "--home", str(tmp_path), "--config", str(cfg)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
        assert not (tmp_path / "models").exists()


def test_max_model_len_from_the_config_file_reaches_the_served_model(tmp_path, tiny_model_dir):
    from engine.launch import build_engine

    cfg = tmp_path / "pg.toml"
    cfg.write_text(f'[engine]\nmodel = "{tiny_model_dir}"\nkv_blocks = 64\nmax_model_len = 200\n')
    settings = build_settings(build_parser().parse_args(["serve", "--config", str(cfg)]), tmp_path)
    flagged = build_settings(build_parser().parse_args(["serve", "--config", str(cfg), "--max-model-len", "96"]),
                             tmp_path)
    assert flagged.engine_config().max_model_len == 96  # the flag beats the file
    engine = build_engine(settings.engine_config())
    try:
        assert [card.max_model_len for card in engine.models()] == [200]
    finally:
        engine.shutdown()


def test_prepare_lane_settings_reach_the_engine_config(tmp_path):
    cfg = tmp_path / "pg.toml"
    cfg.write_text("[engine]\nprepare_workers = 2\nprepare_queued_per_tenant = 5\n")
    config = GatewaySettings(model_dir=tmp_path, **read_config_file(cfg)).engine_config()
    assert (config.prepare_workers, config.prepare_queued_per_tenant) == (2, 5)
