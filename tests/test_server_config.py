"""bin/serve's flags become one ServerConfig, each process's view built once from it."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from conveyor.checkpoints.model_config import ModelConfig
from conveyor.cli import serve
from conveyor.runtime.config import (
    FrontendConfig,
    HttpConfig,
    Policy,
    Preemption,
    RunnerConfig,
    SchedulerConfig,
    SchedulerProcessConfig,
    ServerConfig,
    WorkerConfig,
)

# Flags that name no field of a view: server_config converts each of them by hand (debug:
# bin/serve's own, how it reports a start-up error). (Flags
# the supervisor reads itself, serve_on_replica_death and the multi-node ones, are fields of
# ServerConfig, the supervisor's view.)
CONVERTED = {
    "model", "host", "port", "num_kv_blocks", "kv_cache_memory", "threads", "pipeline_steps", "swap_space",
    "plan_transport",
    "api_key", "api_key_file", "debug",
}  # fmt: skip


def build(*flags: str, run_dir: str = "/tmp/conveyor-test-run"):
    flags = flags if "--model" in flags else ("--model", "demo", *flags)  # (the default model is a real one, fetched)
    return serve.server_config(serve.build_parser().parse_args(list(flags)), run_dir)


def test_every_flag_reaches_a_view() -> None:
    views = (
        FrontendConfig,
        WorkerConfig,
        RunnerConfig,
        SchedulerConfig,
        SchedulerProcessConfig,
        HttpConfig,
        ServerConfig,
    )
    fields = {f.name for view in views for f in dataclasses.fields(view)}
    dests = {a.dest for a in serve.build_parser()._actions if a.dest != "help"}
    assert dests - fields - CONVERTED == set()


def test_api_keys_come_from_flags_a_file_and_the_environment(tmp_path, monkeypatch) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# ops\nfile-key\n\n  spaced  \nflag-key\n")
    monkeypatch.setenv("CONVEYOR_API_KEY", "env-key")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    config = build("--http-port", "0", "--api-key", "flag-key", "--api-key-file", str(keys), "--api-key-everywhere")
    assert config.http.api_keys == ("flag-key", "file-key", "spaced", "env-key") and config.http.api_key_everywhere
    assert config.http.model_dir == config.frontend.model_dir
    monkeypatch.delenv("CONVEYOR_API_KEY")
    assert build("--http-port", "0").http.api_keys == ()
    with pytest.raises(ValueError, match="go together"):
        build("--http-port", "0", "--ssl-certfile", "cert.pem")


def test_flags_land_in_every_view_that_has_them() -> None:
    config = build(
        "--no-profile", "--block-size", "8", "--num-kv-blocks", "64", "--policy", "priority",
        "--swap-bandwidth", "2", "--preemption", "swap", "--threads", "3", "--tokenizer-threads", "0",
    )  # fmt: skip
    assert not config.frontend.profile and not config.worker.profile and not config.scheduler.profile
    assert config.worker.runner.block_size == config.scheduler.scheduler.block_size == 8
    batcher = config.scheduler.scheduler
    assert batcher.policy is Policy.PRIORITY and batcher.policy == "priority"
    assert batcher.preemption is Preemption.SWAP and batcher.swap_bandwidth == 2e9
    assert config.worker.runner.num_blocks == 64 and config.worker.runner.kv_cache_memory_bytes is None
    assert config.worker.runner.num_threads == 3 and config.frontend.tokenizer_threads == 0
    assert config.frontend.addresses is config.worker.addresses is config.scheduler.addresses
    assert config.frontend.max_model_len == batcher.max_model_len


def test_defaults_are_the_config_classes_own() -> None:
    config = build()
    assert config.scheduler.scheduler == dataclasses.replace(
        SchedulerConfig(num_blocks=1), max_model_len=config.frontend.max_model_len
    )
    assert config.worker.runner.kv_cache_memory_bytes == 2**30 and config.scheduler.overlap and config.frontend.profile


def test_the_scheduler_view_is_sized_by_the_worker_and_crosses_a_spawn() -> None:
    config = build()
    sized = config.sized_scheduler(num_blocks=100, num_cpu_blocks=7, block_bytes=4096)
    assert (sized.scheduler.num_blocks, sized.scheduler.num_cpu_blocks, sized.scheduler.block_bytes) == (100, 7, 4096)
    assert pickle.loads(pickle.dumps(sized)) == sized
    assert pickle.loads(pickle.dumps(config)) == config
    with pytest.raises(ValueError, match="num_blocks"):
        config.sized_scheduler(num_blocks=0, num_cpu_blocks=0, block_bytes=0)


def test_a_bad_value_is_refused_before_any_process_starts() -> None:
    with pytest.raises(ValueError, match="max_model_len|max-model-len"):
        build("--max-model-len", "1000000")
    with pytest.raises(ValueError, match="min_batch_size"):
        build("--min-batch-size", "0")


def test_the_draft_model_flags_reach_the_scheduler_and_the_worker_and_a_bad_draft_stops_serve(tmp_path) -> None:
    from conveyor.runtime.model_source import StartupError, resolve_model

    demo, _ = resolve_model("demo")
    draft_flags = ("--speculative-method", "draft", "--speculative-model", demo, "--num-speculative-tokens", "3")
    config = build(*draft_flags)
    batcher = config.scheduler.scheduler
    assert (batcher.speculative_method, batcher.speculative_model, batcher.speculative_tokens) == ("draft", demo, 3)
    assert config.worker.runner.speculative_model == demo
    with pytest.raises(ValueError, match="go together"):
        build("--speculative-method", "draft", "--num-speculative-tokens", "3")
    with pytest.raises(ValueError, match="go together"):
        build("--speculative-method", "ngram", "--speculative-model", demo, "--num-speculative-tokens", "3")
    split = build(*draft_flags, "--tensor-parallel-size", "2")  # every rank runs its shard of the draft
    assert [w.runner.speculative_model for w in split.worker_ranks()] == [demo, demo]

    def write_draft(vocab_size: int, heads: int) -> None:
        (tmp_path / "config.json").write_text(
            f'{{"architectures": ["LlamaForCausalLM"], "vocab_size": {vocab_size}, "hidden_size": {16 * heads}, '
            f'"intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": {heads}, '
            f'"max_position_embeddings": 4096}}'
        )

    write_draft(320, 2)
    with pytest.raises(ValueError, match="320 tokens, the served model's"):
        build("--speculative-method", "draft", "--speculative-model", str(tmp_path), "--num-speculative-tokens", "3")
    write_draft(ModelConfig.from_dir(demo).vocab_size, 3)
    three_heads = (
        "--speculative-method",
        "draft",
        "--speculative-model",
        str(tmp_path),
        "--num-speculative-tokens",
        "3",
    )
    build(*three_heads)
    with pytest.raises(
        ValueError,
        match=f"--speculative-model {tmp_path}: num_attention_heads 3 does not divide by the tensor-parallel size 2",
    ):
        build(*three_heads, "--tensor-parallel-size", "2")
    with pytest.raises(
        ValueError, match="--model .*: num_attention_heads 8 does not divide by the tensor-parallel size 3"
    ):
        build("--tensor-parallel-size", "3")  # the served model's own heads, as well
    with pytest.raises(StartupError, match="speculative-model .*nowhere: no config.json"):  # (serve exits 2 with it)
        build(
            "--speculative-method",
            "draft",
            "--speculative-model",
            str(tmp_path / "nowhere"),
            "--num-speculative-tokens",
            "2",
        )


def test_a_mode_given_as_a_string_becomes_its_enum_member() -> None:
    config = SchedulerConfig(num_blocks=4, policy="priority", preemption="recompute")
    assert config.policy is Policy.PRIORITY and f"{config.policy}" == "priority"
    with pytest.raises(ValueError, match="batching must be one of continuous, static"):
        SchedulerConfig(num_blocks=4, batching="dynamic")


def test_the_exposed_http_warning_stays_until_a_key_is_set(capsys) -> None:
    serve.warn_if_exposed(build("--http-port", "0", "--http-host", "0.0.0.0"))
    assert "no --api-key is set" in capsys.readouterr().err
    serve.warn_if_exposed(build("--http-port", "0", "--http-host", "0.0.0.0", "--api-key", "k"))
    assert "HTTP listeners" not in capsys.readouterr().err
    serve.warn_if_exposed(build("--http-port", "0"))  # loopback: nothing to warn about
    assert "HTTP listeners" not in capsys.readouterr().err


def test_the_ready_line_counts_the_data_parallel_replicas() -> None:
    """Every replica's cache, not replica 0's as if it were the server's."""
    one = build("--num-kv-blocks", "64")
    assert serve.ready_line(one, [{"num_blocks": 64, "device": "cpu"}]).endswith(
        "on cpu with 64 KV blocks of 16 tokens"
    )
    two = build("--num-kv-blocks", "64", "--data-parallel-size", "2")
    line = serve.ready_line(two, [{"num_blocks": 64, "device": "cpu"}] * 2)
    assert (
        line.endswith("on cpu with 2 data-parallel replicas of 64 KV blocks of 16 tokens each")
        and "replica 0" not in line
    )
    uneven = serve.ready_line(two, [{"num_blocks": 64, "device": "cuda:0"}, {"num_blocks": 60, "device": "cuda:1"}])
    assert uneven.endswith("on cuda:0, cuda:1 with 2 data-parallel replicas of 64/60 KV blocks of 16 tokens")


def test_config_errors_name_the_flags() -> None:
    parser = serve.build_parser()
    assert (
        serve.in_flag_terms("max_num_seqs must be positive, got 0", parser) == "--max-num-seqs must be positive, got 0"
    )
    assert serve.in_flag_terms("num_blocks must be positive", parser) == "--num-kv-blocks must be positive"
    # A field inside a path or a longer name is left alone; one with no flag too.
    assert serve.in_flag_terms("/x/max_num_seqs/y: block_bytes", parser) == "/x/max_num_seqs/y: block_bytes"
    assert serve.in_flag_terms("no CUDA device on this host", parser) == "no CUDA device on this host"  # prose stays


def test_every_replica_and_rank_is_a_cpu_slot_of_its_own() -> None:
    """The workers of one machine share its cores: each (replica, rank) a slot, numbered apart."""
    config = build("--data-parallel-size", "2", "--tensor-parallel-size", "2")
    ranks = [rank for index in range(2) for rank in config.replica(index).worker_ranks()]
    assert [(w.cpu_slot, w.cpu_slots) for w in ranks] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert all(w.cpu_bind for w in ranks) and not build("--no-cpu-bind").worker.cpu_bind
    assert serve.cpu_threads_note({"device": "cpu", "threads": 1, "omp_wait_policy": "PASSIVE", "cores": "0"}) == (
        " (1 threads on core 0, OpenMP waits PASSIVE)"
    )
    floating = {"device": "cpu", "threads": 3, "omp_wait_policy": "PASSIVE", "cores": ""}
    assert serve.cpu_threads_note(floating) == " (3 threads floating, OpenMP waits PASSIVE)"
