"""Engine metrics parsers: every fixture in tests/data/metrics parsed to an exact EngineSample, the
name and aggregation rules (new vs old vLLM names, newest LoRA series, DP sums, SGLang TP mirrors,
Triton GPUs and TRT-LLM series), queue time from two scrapes, and the live expositions of our own
simulator and ONNX Runtime server."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from extproc.datalayer.engine_metrics import (
    EngineSample, MetricsParseError, detect_engine, normalise_engine, parse_metrics, queue_duration)

DATA = Path(__file__).resolve().parents[2] / "data" / "metrics"


def fixture(name: str) -> str:
    return (DATA / name).read_text()


def fields(sample: EngineSample) -> dict:
    out = dataclasses.asdict(sample)
    out.pop("queue_time_totals")
    return out


EXPECTED = {
    "vllm.txt": dict(engine="vllm", queue=3, running=12, kv_usage=0.4219, lora_running=("finance-lora", "legal-lora"),
                     lora_waiting=("sql-lora",), max_lora=4, models=("meta-llama/Llama-3.1-8B-Instruct",)),
    "vllm_v0.txt": dict(engine="vllm", queue=7, running=4, kv_usage=0.9132, models=("llama-2-7b",)),
    "vllm_dp.txt": dict(engine="vllm", queue=7, running=17, kv_usage=0.7, models=("Qwen/Qwen3-8B",)),
    "simulator.txt": dict(engine="vllm", queue=2, running=2, kv_usage=0.053955078125, lora_running=("finance-lora",),
                          lora_waiting=("legal-lora",), max_lora=2, models=("llama-3-8b",)),
    "sglang.txt": dict(engine="sglang", queue=2826, running=162, kv_usage=0.28,
                       models=("meta-llama/Llama-3.1-8B-Instruct",)),
    "sglang_ranks.txt": dict(engine="sglang", queue=4, running=30, kv_usage=0.63, lora_loaded=3, max_lora=8,
                             models=("Qwen/Qwen3-32B",)),
    "triton.txt": dict(engine="triton", queue=8, gpu_utilization=pytest.approx(0.6), gpu_memory_used_bytes=53687091200,
                       gpu_memory_total_bytes=171798691840, models=("densenet_onnx", "bert_trt")),
    "triton_trtllm.txt": dict(engine="triton", queue=9, running=14, kv_usage=0.9, models=("tensorrt_llm",)),
    "onnxruntime.txt": dict(engine="onnxruntime", queue=4, models=("fraud-mlp", "risk-classifier")),
    "llamacpp.txt": dict(engine="llamacpp", queue=2, running=4),
    "llamacpp_legacy.txt": dict(engine="llamacpp", queue=0, running=1, kv_usage=0.85),
}


def test_every_fixture_is_listed_and_cites_its_source():
    assert sorted(p.name for p in DATA.glob("*.txt")) == sorted(EXPECTED)
    for name in EXPECTED:
        first = fixture(name).splitlines()[0]
        assert first.startswith("# Source: ") and len(first) > 60, name


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_parses_to_the_exact_sample(name):
    text = fixture(name)
    want = EXPECTED[name]
    assert detect_engine(text) == want["engine"]
    got = fields(parse_metrics(want["engine"], text))
    blank = {k: None for k in got} | {"models": ()}
    assert got == blank | want  # everything not listed is None: the engine does not export it
    assert got["queue_duration_s"] is None  # one scrape: no delta yet


def test_queue_duration_needs_two_scrapes_and_is_the_mean_of_the_window():
    first = parse_metrics("vllm", fixture("vllm.txt"))
    assert first.queue_time_totals == (22.1, 442.0)
    later = (fixture("vllm.txt")
             .replace('vllm:request_queue_time_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 22.1',
                      'vllm:request_queue_time_seconds_sum{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 24.1')
             .replace('vllm:request_queue_time_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 442.0',
                      'vllm:request_queue_time_seconds_count{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 452.0'))
    second = parse_metrics("vllm", later, previous=first)
    assert second.queue_duration_s == pytest.approx(0.2)  # 2.0 s over 10 requests


def test_triton_queue_duration_is_the_microsecond_counter_over_successes():
    first = parse_metrics("triton", fixture("triton.txt"))
    assert first.queue_time_totals == (pytest.approx(2.0), 2000.0)  # (1.5e6 + 0.5e6) us, 1200 + 800 requests
    later = (fixture("triton.txt")
             .replace('nv_inference_queue_duration_us{model="densenet_onnx",version="1"} 1500000',
                      'nv_inference_queue_duration_us{model="densenet_onnx",version="1"} 1800000')
             .replace('nv_inference_request_success{model="densenet_onnx",version="1"} 1200',
                      'nv_inference_request_success{model="densenet_onnx",version="1"} 1300'))
    assert parse_metrics("triton", later, previous=first).queue_duration_s == pytest.approx(0.003)  # 0.3 s / 100


def test_queue_duration_rules():
    prev = EngineSample(engine="vllm", queue=0, queue_duration_s=0.5, queue_time_totals=(10.0, 100.0))
    assert queue_duration(None, prev, 0) is None  # the engine has no queue-time series
    assert queue_duration((12.0, 110.0), None, 0) is None  # first scrape
    assert queue_duration((12.0, 110.0), prev, 0) == pytest.approx(0.2)
    assert queue_duration((10.0, 100.0), prev, 0) == 0.0  # nobody left the queue and it is empty
    assert queue_duration((10.0, 100.0), prev, 3) == 0.5  # nobody left a non-empty queue: keep the last wait
    assert queue_duration((1.0, 4.0), prev, 0) == pytest.approx(0.25)  # counters reset (restart): new totals are the delta


def test_vllm_prefers_the_new_kv_name_and_falls_back_to_the_old():
    both = ('vllm:kv_cache_usage_perc{model_name="m"} 0.25\n'
            'vllm:gpu_cache_usage_perc{model_name="m"} 0.75\n')
    assert parse_metrics("vllm", both).kv_usage == 0.25
    assert parse_metrics("vllm", 'vllm:gpu_cache_usage_perc{model_name="m"} 0.75\n').kv_usage == 0.75
    assert parse_metrics("vllm", 'vllm:num_requests_waiting{model_name="m"} 1\n').kv_usage is None


def test_vllm_lora_info_takes_the_newest_series_whatever_the_order():
    lines = fixture("vllm.txt").splitlines()
    info = [line for line in lines if line.startswith("vllm:lora_requests_info{")]
    assert len(info) == 3
    rest = [line for line in lines if line not in info]
    for order in (info, info[::-1], [info[1], info[2], info[0]]):
        sample = parse_metrics("vllm", "\n".join(rest + order) + "\n")
        assert (sample.lora_running, sample.lora_waiting, sample.max_lora) == (
            ("finance-lora", "legal-lora"), ("sql-lora",), 4)


def test_vllm_lora_info_with_no_adapter_busy_is_empty_not_none():
    text = 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.7e9\n'
    sample = parse_metrics("vllm", text)
    assert (sample.lora_running, sample.lora_waiting, sample.max_lora) == ((), (), 2)
    assert parse_metrics("vllm", 'vllm:num_requests_waiting{model_name="m"} 0\n').lora_running is None


def test_sglang_tp_ranks_are_one_state_but_dp_ranks_add_up():
    ranks = fixture("sglang_ranks.txt")
    assert parse_metrics("sglang", ranks).queue == 4  # tp_rank 0 and 1 report the same queue
    assert parse_metrics("sglang", ranks).queue_time_totals == (12.5, 100.0)
    dp = ('sglang:num_queue_reqs{dp_rank="0",model_name="m",tp_rank="0"} 3\n'
          'sglang:num_queue_reqs{dp_rank="1",model_name="m",tp_rank="1"} 5\n'
          'sglang:token_usage{dp_rank="0",model_name="m",tp_rank="0"} 0.2\n'
          'sglang:token_usage{dp_rank="1",model_name="m",tp_rank="1"} 0.9\n')
    sample = parse_metrics("sglang", dp)
    assert (sample.queue, sample.kv_usage) == (8, 0.9)


def test_triton_trtllm_kv_from_blocks_when_no_fraction_and_pending_when_no_waiting():
    text = "\n".join(line for line in fixture("triton_trtllm.txt").splitlines()
                     if 'request_type="waiting"' not in line and 'kv_cache_block_type="fraction"' not in line)
    sample = parse_metrics("triton", text)
    assert sample.kv_usage == pytest.approx(5615 / 6239)
    assert sample.queue == 0  # nv_inference_pending_request_count
    assert sample.running == 14


def test_counters_are_found_with_and_without_type_lines_and_total_suffix():
    typed = ("# TYPE nv_inference_queue_duration_us counter\n"
             'nv_inference_queue_duration_us{model="a",version="1"} 1000000\n'
             "# TYPE nv_inference_request_success counter\n"
             'nv_inference_request_success{model="a",version="1"} 4\n')
    untyped = typed.replace("# TYPE nv_inference_queue_duration_us counter\n", "").replace(
        "# TYPE nv_inference_request_success counter\n", "")
    for text in (typed, untyped):
        assert parse_metrics("triton", text).queue_time_totals == (1.0, 4.0)


def test_nan_and_out_of_range_values():
    text = ('vllm:num_requests_waiting{model_name="m"} NaN\n'
            'vllm:kv_cache_usage_perc{model_name="m"} 1.7\n')
    sample = parse_metrics("vllm", text)
    assert sample.queue is None  # NaN is not a reading
    assert sample.kv_usage == 1.0  # clamped to [0, 1]


def test_engine_names_and_errors():
    assert normalise_engine("Simulator") == "vllm"
    assert normalise_engine("llama.cpp") == "llamacpp"
    assert normalise_engine("ort") == "onnxruntime"
    with pytest.raises(MetricsParseError, match="unknown engine 'tgi'"):
        parse_metrics("tgi", "")
    with pytest.raises(MetricsParseError, match="not Prometheus text"):
        parse_metrics("vllm", 'vllm:num_requests_waiting{model_name="m" 3\n')
    assert detect_engine("# only comments\n") is None
    empty = parse_metrics("llamacpp", "")
    assert (empty.queue, empty.running, empty.kv_usage) == (None, None, None)


def test_busy_is_queue_or_running():
    assert EngineSample(engine="vllm", queue=0, running=1).busy
    assert EngineSample(engine="vllm", queue=2, running=0).busy
    assert not EngineSample(engine="vllm", queue=0, running=0).busy
    assert not EngineSample(engine="triton").busy


def test_live_simulator_exposition_parses_by_the_vllm_names():
    sim = pytest.importorskip("backends.simulator_openai")
    app = sim.build_app(sim.SimulatorSettings(models=("base-a", "base-b"), loras=(("ad-1", "base-a"),)))
    sample = parse_metrics("simulator", generate_latest(app.registry).decode())
    assert (sample.engine, sample.queue, sample.running, sample.kv_usage) == ("vllm", 0, 0, 0.0)
    assert sample.models == ("base-a", "base-b")
    assert (sample.lora_running, sample.lora_waiting) == ((), ())
    assert sample.max_lora is not None and sample.max_lora >= 1
    assert sample.queue_time_totals == (0.0, 0.0)


def test_live_onnxruntime_exposition():
    from backends.onnxruntime.config import BatchingSettings
    from backends.onnxruntime.metrics import ModelBatchObserver, OrtMetrics

    metrics = OrtMetrics()
    metrics.model_state("fraud-mlp", "1", True, "fp32", ["fp32"], ["CPUExecutionProvider"])
    metrics.batching("fraud-mlp", "1", BatchingSettings())
    metrics.queue_depth.labels("fraud-mlp", "1").set(2)
    metrics.queue_depth.labels("fraud-mlp", "2").set(1)
    ModelBatchObserver(metrics, "fraud-mlp").batch_done(rows=2, requests=2, queue_seconds=[0.01, 0.03],
                                                         run_seconds=0.001, ok=True)
    first = parse_metrics("onnxruntime", metrics.exposition().decode())
    assert (first.queue, first.running, first.kv_usage, first.models) == (3, None, None, ("fraud-mlp",))
    assert first.queue_time_totals == (pytest.approx(0.04), 2.0)
    ModelBatchObserver(metrics, "fraud-mlp").batch_done(rows=1, requests=1, queue_seconds=[0.5], run_seconds=0.001,
                                                         ok=True)
    assert parse_metrics("onnxruntime", metrics.exposition().decode(), first).queue_duration_s == pytest.approx(0.5)
