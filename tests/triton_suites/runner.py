"""Triton's own client examples and QA tests, run against Triton and through the frontend.

Every item (one example script, or one test method of a vendored ``qa/L0_*`` file) runs
twice as a subprocess of the project's Python: once against Triton direct, once against
the frontend with the tenant's key. The only adaptation is ``shim/sitecustomize.py``
(where the server is; the key on every call); the vendored files are Triton's, unchanged
(``vendor/SOURCES.md``).

What the frontend deliberately does not offer is listed in ``EXCEPTIONS`` with the answer
the client gets instead; QA tests whose models or server flags this suite cannot stand in
for are in ``NOT_RUN`` with why. Both lists are part of the report, never silently dropped.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENDOR = HERE / "vendor"
EXAMPLES = VENDOR / "client_examples"
QA = VENDOR / "qa"
SHIM = HERE / "shim"

DIRECT = "direct"
FRONTEND = "frontend"
SIDES = (DIRECT, FRONTEND)

# Per subprocess: the slowest example (repeat_int32: ten responses 1 s apart) takes ~11 s.
ITEM_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Item:
    """One thing that passes or fails: an example run, or one QA test method."""

    suite: str
    name: str
    # Items sharing a ``serial`` key never run at the same time, on either side: they use
    # fixed sequence ids or a model whose queue holds one request, and the frontend's
    # Triton is the direct side's Triton.
    serial: str | None = None

    @property
    def id(self) -> str:
        return f"{self.suite}::{self.name}"


@dataclass(frozen=True)
class Example:
    """A client example script and its command line (``-u URL`` is added per side)."""

    script: str
    protocol: str  # "http" or "grpc": which URL ``-u`` gets
    args: tuple[str, ...] = ()
    serial: str | None = None

    @property
    def item(self) -> Item:
        name = self.script + ("" if not self.args else " " + " ".join(self.args))
        return Item("client_examples", name, self.serial)


SEQ = "sequence-ids"  # the sequence examples use correlation ids 1000-1002
# Examples that register system shared memory under fixed region names, and first unregister
# every region Triton holds: two at once against the same Triton take each other's regions
# ("Unable to find shared memory region: 'output0_data'", seen against Triton itself).
SHM = "system shared memory"

EXAMPLE_RUNS: tuple[Example, ...] = (
    Example("simple_http_infer_client.py", "http"),
    Example("simple_http_async_infer_client.py", "http"),
    Example("simple_http_aio_infer_client.py", "http"),
    Example("simple_http_health_metadata.py", "http"),
    Example("simple_http_string_infer_client.py", "http"),
    Example("simple_http_sequence_sync_infer_client.py", "http", serial=SEQ),
    Example("simple_http_sequence_sync_infer_client.py", "http", ("-d",), serial=SEQ),
    Example("simple_grpc_infer_client.py", "grpc"),
    Example("simple_grpc_async_infer_client.py", "grpc"),
    Example("simple_grpc_aio_infer_client.py", "grpc"),
    Example("simple_grpc_health_metadata.py", "grpc"),
    Example("simple_grpc_string_infer_client.py", "grpc"),
    Example("simple_grpc_custom_args_client.py", "grpc"),
    Example("simple_grpc_keepalive_client.py", "grpc"),
    Example("simple_grpc_custom_repeat.py", "grpc"),
    Example("simple_grpc_sequence_sync_infer_client.py", "grpc", serial=SEQ),
    Example("simple_grpc_sequence_sync_infer_client.py", "grpc", ("-d",), serial=SEQ),
    Example("simple_grpc_sequence_stream_infer_client.py", "grpc", serial=SEQ),
    Example("simple_grpc_sequence_stream_infer_client.py", "grpc", ("-d",), serial=SEQ),
    Example("simple_grpc_aio_sequence_stream_infer_client.py", "grpc", serial=SEQ),
    Example("simple_grpc_aio_sequence_stream_infer_client.py", "grpc", ("-d",), serial=SEQ),
    Example("grpc_explicit_int_content_client.py", "grpc"),
    Example("grpc_explicit_int8_content_client.py", "grpc"),
    Example("grpc_explicit_byte_content_client.py", "grpc"),
    Example("reuse_infer_objects_client.py", "http", ("-i", "http"), serial=SHM),
    Example("reuse_infer_objects_client.py", "grpc", ("-i", "grpc"), serial=SHM),
    # What the frontend does not offer (EXCEPTIONS): run too, to check the answer it gives.
    Example("simple_http_shm_client.py", "http", serial=SHM),
    Example("simple_http_shm_string_client.py", "http", serial=SHM),
    Example("simple_grpc_shm_client.py", "grpc", serial=SHM),
    Example("simple_grpc_shm_string_client.py", "grpc", serial=SHM),
    Example("simple_http_cudashm_client.py", "http", serial=SHM),
    Example("simple_grpc_cudashm_client.py", "grpc", serial=SHM),
    Example("simple_http_model_control.py", "http"),
    Example("simple_grpc_model_control.py", "grpc"),
)


@dataclass(frozen=True)
class QaFile:
    """A vendored ``qa/L0_*`` test file, run with pytest (one result per test method)."""

    suite: str
    path: str  # under vendor/qa
    env: tuple[tuple[str, str], ...] = ()
    serial: str | None = None


QA_FILES: tuple[QaFile, ...] = (
    # test_descriptive_status_code fills a one-request queue: both sides must not share it.
    QaFile("L0_http", "L0_http/http_test.py", serial="onnx_zero_1_float32_queue"),
    # test.sh runs it four times with different server flags; only TEST_HEADER=test_params
    # needs none (the header-forwarding runs start Triton with --*-header-forward-pattern).
    QaFile("L0_parameters", "L0_parameters/parameters_test.py", (("TEST_HEADER", "test_params"),)),
    QaFile("L0_string_io", "L0_string_io/string_client_test.py"),
    QaFile("L0_input_validation", "L0_input_validation/input_validation_test.py"),
)


@dataclass(frozen=True)
class Exception_:
    """A named difference the frontend means: why, and what the client gets instead."""

    reason: str
    answer: str  # text the client's output contains through the frontend


_SHM = (
    "system shared memory: the frontend serves tenants over the network and never maps a "
    "client's memory; its register/unregister/status endpoints are not served"
)
_CUDASHM = (
    "CUDA shared memory: as system shared memory (and these examples fail against Triton "
    "too without a GPU)"
)
_CONTROL = (
    "model control (load/unload, repository index): the operator's job, not a tenant's; "
    "the frontend does not expose it (the examples fail against Triton too here: it runs "
    "without --model-control-mode=explicit and serves more than their 7-8 models)"
)
# The client's answer through the frontend: HTTP, aiohttp's 404 for a path it does not
# route; gRPC, grpc.aio's answer for a servicer method the frontend does not implement.
_HTTP_ANSWER = "[404] Not Found"
_GRPC_ANSWER = "[StatusCode.UNIMPLEMENTED]"
EXCEPTIONS: dict[str, Exception_] = {
    "client_examples::simple_http_shm_client.py": Exception_(_SHM, _HTTP_ANSWER),
    "client_examples::simple_http_shm_string_client.py": Exception_(_SHM, _HTTP_ANSWER),
    "client_examples::simple_grpc_shm_client.py": Exception_(_SHM, _GRPC_ANSWER),
    "client_examples::simple_grpc_shm_string_client.py": Exception_(_SHM, _GRPC_ANSWER),
    "client_examples::reuse_infer_objects_client.py -i http": Exception_(_SHM, _HTTP_ANSWER),
    "client_examples::reuse_infer_objects_client.py -i grpc": Exception_(_SHM, _GRPC_ANSWER),
    "client_examples::simple_http_cudashm_client.py": Exception_(_CUDASHM, _HTTP_ANSWER),
    "client_examples::simple_grpc_cudashm_client.py": Exception_(_CUDASHM, _GRPC_ANSWER),
    "client_examples::simple_http_model_control.py": Exception_(_CONTROL, _HTTP_ANSWER),
    "client_examples::simple_grpc_model_control.py": Exception_(_CONTROL, _GRPC_ANSWER),
    "L0_http::HttpTest::test_content_encoding_chunked_manually": Exception_(
        "a body with both Content-Length and Transfer-Encoding: chunked is refused (400 "
        "\"Content-Length can't be present with Transfer-Encoding\", aiohttp's parser): "
        "RFC 9112 section 6.3 makes such a message an error a server ought to refuse, the "
        "ambiguity request smuggling uses; Triton's HTTP server accepts it",
        "400 Client Error",
    ),
    "L0_http::HttpTest::test_descriptive_status_code": Exception_(
        "a model's max_queue_size bounds Triton's queue, which the frontend keeps nearly "
        "empty: it queues requests itself, fairly, and sends Triton only what it dispatches, "
        "so a second request to a model that queues one waits and succeeds; the frontend's "
        "own caps (queues.*) answer Triton's 503 'Exceeds maximum queue size'",
        "HTTPError not raised",
    ),
}

# Items still failing through the frontend, and why: an issue 12 item whose fix is not in
# yet, or a difference nobody has taken up (the lead decides: fix, or name an exception).
KNOWN: dict[str, str] = {}

# QA test methods this suite does not run, and why (listed in the report).
NOT_RUN: dict[str, str] = {
    "L0_input_validation::InputShapeTest::test_input_shape_validation": (
        "needs pt_identity (a PyTorch model, libtorch backend: not on this machine)"
    ),
    "L0_input_validation::InputShapeTest::test_input_string_shape_validation": (
        "needs graphdef_object_int32_int32 from Triton's qa model data (not public)"
    ),
    "L0_input_validation::InputShapeTest::test_wrong_input_shape_tensor_size": (
        "needs TensorRT plan models (plan_*_float32_int32) and a GPU"
    ),
    "L0_parameters::header forwarding runs": (
        "test_headers and the header-pattern runs need Triton started with "
        "--grpc/http-header-forward-pattern; the frontend has no such option"
    ),
    "client_examples::image_client.py, grpc_image_client.py, grpc_client.py, "
    "ensemble_image_client.py": "need image models (densenet_onnx, inception_graphdef)",
    "client_examples::memory_growth_test.py": "a long soak test (custom_identity_int32)",
}


# One parse at a time: run_all reads QA files from a thread pool, and on CPython 3.11
# ast.parse in two threads at once can fail ("SystemError: AST constructor recursion depth
# mismatch", the interpreter's AST state is shared; seen on a fresh clone, every item of
# this suite then an error), as can catch_warnings, which swaps the process's filters.
# Each file is parsed once (at collection, in the main thread), then read from _TREES.
_PARSING = threading.Lock()
_TREES: dict[str, ast.Module] = {}


def qa_items(qa: QaFile) -> list[Item]:
    """The test methods of a vendored QA file, read from its source (no import)."""
    with _PARSING:
        tree = _TREES.get(str(qa.path))
        if tree is None:
            with warnings.catch_warnings():  # Triton's files hold invalid escapes ('\\ ')
                warnings.simplefilter("ignore", SyntaxWarning)
                warnings.simplefilter("ignore", DeprecationWarning)
                tree = _TREES[str(qa.path)] = ast.parse((QA / qa.path).read_text())
    items = []
    for cls in tree.body:
        if not isinstance(cls, ast.ClassDef):
            continue
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and fn.name.startswith(
                "test"
            ):
                item = Item(qa.suite, f"{cls.name}::{fn.name}", qa.serial)
                if item.id not in NOT_RUN:
                    items.append(item)
    return items


def all_items() -> list[Item]:
    items = [example.item for example in EXAMPLE_RUNS]
    for qa in QA_FILES:
        items.extend(qa_items(qa))
    return items


@dataclass(frozen=True)
class Target:
    """Where one side's clients go."""

    http: str
    grpc: str
    key: str | None = None


@dataclass
class Outcome:
    passed: bool
    output: str  # the tail of what the client printed (the failure's reason)
    seconds: float


@dataclass
class Results:
    """``outcomes[side][item id]``."""

    outcomes: dict[str, dict[str, Outcome]] = field(default_factory=lambda: {s: {} for s in SIDES})


def _env(target: Target, extra: Iterable[tuple[str, str]] = ()) -> dict[str, str]:
    env = dict(os.environ)
    qa_common = str(QA / "common")
    env["PYTHONPATH"] = os.pathsep.join([str(SHIM), qa_common])
    env["TRITON_SUITES_HTTP"] = target.http
    env["TRITON_SUITES_GRPC"] = target.grpc
    env.pop("TRITON_SUITES_KEY", None)
    if target.key:
        env["TRITON_SUITES_KEY"] = target.key
    env.update(extra)
    return env


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def run_example(example: Example, target: Target) -> Outcome:
    """Passes when the script exits 0 and, where it prints a PASS line, printed it (several
    examples print an error and ``sys.exit()`` with status 0)."""
    source = (EXAMPLES / example.script).read_text()
    url = target.http if example.protocol == "http" else target.grpc
    argv = [sys.executable, str(EXAMPLES / example.script), "-u", url, *example.args]
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as cwd:
        try:
            done = subprocess.run(
                argv, cwd=cwd, env=_env(target), capture_output=True, text=True,
                timeout=ITEM_TIMEOUT_S,
            )  # fmt: skip
        except subprocess.TimeoutExpired as err:
            out = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else ""
            return Outcome(False, f"timed out\n{_tail(out)}", time.monotonic() - started)
    output = done.stdout + done.stderr
    passed = done.returncode == 0 and ("PASS" not in source or "PASS" in done.stdout)
    return Outcome(passed, _tail(output), time.monotonic() - started)


_STARTED = re.compile(r"^(test\w*) \(([\w.]+)\)", re.MULTILINE)
_SKIPPED = re.compile(r"^(test\w*) \(([\w.]+)\).*?\.\.\. skipped", re.MULTILINE)
_FAILED = re.compile(r"^(?:FAIL|ERROR): (\w+) \(([\w.]+)\)", re.MULTILINE)


def _method(name: str, qualified: str) -> str:
    """``Class::test`` from unittest's ``test (module.Class.test)`` (or ``module.Class``)."""
    parts = qualified.split(".")
    cls = parts[-2] if parts[-1] == name and len(parts) > 1 else parts[-1]
    return f"{cls}::{name}"


def run_qa_file(qa: QaFile, target: Target) -> dict[str, Outcome]:
    """All of a QA file's test methods in one run, as its ``test.sh`` runs it
    (``python <file>``: unittest, whose ``TestResultCollector`` pytest cannot host), with
    ``-v``; one outcome per method, from unittest's report on stderr."""
    started = time.monotonic()
    items = qa_items(qa)
    argv = [sys.executable, str(QA / qa.path), "-v", *(i.name.replace("::", ".") for i in items)]
    with tempfile.TemporaryDirectory() as cwd:
        try:
            done = subprocess.run(
                argv, cwd=cwd, env=_env(target, qa.env), capture_output=True, text=True,
                timeout=ITEM_TIMEOUT_S,
            )  # fmt: skip
            report, output = done.stderr, done.stdout + done.stderr
        except subprocess.TimeoutExpired:
            report, output = "", "timed out"
    seconds = time.monotonic() - started
    ran = {_method(*m) for m in _STARTED.findall(report)}
    skipped = {_method(*m) for m in _SKIPPED.findall(report)}
    sections = re.split(r"^=+$", report, flags=re.MULTILINE)
    failed: dict[str, str] = {}
    for section in sections:
        match = _FAILED.search(section)
        if match:
            failed[_method(*match.groups())] = _tail(section)
    outcomes = {}
    for item in items:
        if item.name in failed:
            outcomes[item.id] = Outcome(False, failed[item.name], seconds)
        elif item.name in skipped:
            outcomes[item.id] = Outcome(False, "skipped", seconds)
        elif item.name in ran:
            outcomes[item.id] = Outcome(True, "", seconds)
        else:
            outcomes[item.id] = Outcome(False, _tail(output), seconds)
    return outcomes


def run_all(
    targets: dict[str, Target],
    jobs: int = 6,
    progress: Callable[[str], None] = print,
) -> Results:
    """Every item on every side, ``jobs`` subprocesses at a time; items with the same
    ``serial`` key one at a time."""
    results = Results()
    locks: dict[str, threading.Lock] = {}
    for item in all_items():
        if item.serial:
            locks.setdefault(item.serial, threading.Lock())
    for qa in QA_FILES:
        if qa.serial:
            locks.setdefault(qa.serial, threading.Lock())
    record_lock = threading.Lock()

    def record(side: str, item_id: str, outcome: Outcome) -> None:
        with record_lock:
            results.outcomes[side][item_id] = outcome
        verdict = "pass" if outcome.passed else "FAIL"
        progress(f"[{side:8}] {verdict} {item_id} ({outcome.seconds:.1f}s)")

    def example_job(example: Example, side: str) -> None:
        lock = locks.get(example.serial or "")
        if lock:
            with lock:
                outcome = run_example(example, targets[side])
        else:
            outcome = run_example(example, targets[side])
        record(side, example.item.id, outcome)

    def qa_job(qa: QaFile, side: str) -> None:
        lock = locks.get(qa.serial or "")
        if lock:
            with lock:
                outcomes = run_qa_file(qa, targets[side])
        else:
            outcomes = run_qa_file(qa, targets[side])
        for item_id, outcome in outcomes.items():
            record(side, item_id, outcome)

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(qa_job, qa, side) for qa in QA_FILES for side in SIDES]
        futures += [pool.submit(example_job, ex, side) for ex in EXAMPLE_RUNS for side in SIDES]
        for future in futures:
            future.result()
    return results


def suites() -> list[str]:
    return ["client_examples", *(qa.suite for qa in QA_FILES)]


def summary(results: Results) -> dict[str, object]:
    """Pass counts per suite and side, and every item where the sides differ."""
    counts: dict[str, dict[str, object]] = {}
    for suite in suites():
        ids = [i.id for i in all_items() if i.suite == suite]
        counts[suite] = {
            "items": len(ids),
            **{
                side: sum(
                    1 for i in ids if results.outcomes[side].get(i, Outcome(False, "", 0)).passed
                )
                for side in SIDES
            },
        }
    differences = []
    for item in all_items():
        direct = results.outcomes[DIRECT].get(item.id)
        through = results.outcomes[FRONTEND].get(item.id)
        if direct is None or through is None or direct.passed == through.passed:
            continue
        exception = EXCEPTIONS.get(item.id)
        differences.append(
            {
                "item": item.id,
                "direct": "pass" if direct.passed else "fail",
                "frontend": "pass" if through.passed else "fail",
                "named_exception": exception.reason if exception else None,
                "known": KNOWN.get(item.id),
                "frontend_output": through.output,
                "direct_output": direct.output if not direct.passed else "",
            }
        )
    return {
        "counts": counts,
        "differences": differences,
        "exceptions": {k: {"reason": v.reason, "answer": v.answer} for k, v in EXCEPTIONS.items()},
        "known": KNOWN,
        "not_run": NOT_RUN,
    }
