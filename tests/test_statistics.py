"""Triton's statistics extension, answered for what went through the frontend."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

from fair_frontend.kit.testing import perf_analyzer_binary
from tests.support import KEYS, ids_input, make_config, running_frontend


def test_statistics_count_what_the_frontend_answered(triton, workers: int) -> None:
    with running_frontend(make_config(), triton, workers=workers) as fe:
        grpc = grpcclient.InferenceServerClient(fe.grpc_url)
        meta = grpc.get_server_metadata()
        assert "statistics" in meta.extensions
        headers = {"x-api-key": KEYS["acme"]}  # statistics are keyed
        # Known but unused: one entry of zeros, as Triton gives.
        empty = grpc.get_inference_statistics("generate", headers=headers).model_stats
        assert [(m.name, m.inference_count, m.execution_count) for m in empty] == [
            ("generate", 0, 0)
        ]
        for rows in (1, 2, 3):
            ids = np.arange(rows * 8, dtype=np.int32).reshape(rows, 8)
            grpc.infer("embed", [ids_input(grpcclient, ids)], headers=headers)
        with pytest.raises(InferenceServerException):
            bad = np.zeros((1, 8), dtype=np.int64)
            inp = grpcclient.InferInput("INPUT_IDS", [1, 8], "INT64")
            inp.set_data_from_numpy(bad)
            grpc.infer("embed", [inp], headers=headers)

        (stats,) = grpc.get_inference_statistics("embed", headers=headers).model_stats
        assert stats.name == "embed" and stats.version == "1"
        assert stats.inference_count == 6  # rows
        assert stats.execution_count == 3  # one batch each, sent one after another
        s = stats.inference_stats
        assert s.success.count == 3 and s.success.ns > 0
        assert s.fail.count == 1
        assert s.queue.count == 3 and s.compute_infer.count == 3
        assert s.success.ns >= s.queue.ns + s.compute_infer.ns
        assert sorted(b.batch_size for b in stats.batch_stats) == [1, 2, 3]
        assert stats.last_inference > 0

        http = httpclient.InferenceServerClient(fe.http_url)
        (doc,) = http.get_inference_statistics("embed", headers=headers)["model_stats"]
        assert doc["inference_count"] == 6 and isinstance(doc["inference_count"], int)
        assert doc["inference_stats"]["success"]["count"] == 3
        everything = http.get_inference_statistics(headers=headers)
        assert {m["name"] for m in everything["model_stats"]} == {"embed"}

        with pytest.raises(InferenceServerException) as info:
            grpc.get_inference_statistics("no_such_model", headers=headers)
        assert "unknown model" in info.value.message()


def test_perf_analyzer_reads_the_frontends_statistics(triton, workers: int) -> None:
    """perf_analyzer asks for statistics when the server lists the extension."""
    with running_frontend(make_config(), triton, workers=workers) as fe:
        proc = subprocess.run(
            [
                perf_analyzer_binary(),
                "-m",
                "embed",
                "--shape",
                "INPUT_IDS:32",
                "-u",
                fe.grpc_url,
                "-i",
                "grpc",
                "-H",
                f"authorization: Bearer {KEYS['acme']}",
                "--measurement-mode",
                "count_windows",
                "--measurement-request-count",
                "50",
                "--stability-percentage",
                "1000",  # any spread: a loaded machine's windows differ
            ],
            capture_output=True,
            text=True,
            timeout=180,
        )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Server:" in proc.stdout and "Inference count:" in proc.stdout
