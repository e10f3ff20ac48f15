"""One source for every setting: the flags come from the config dataclasses, and `up` passes them on."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Literal

import pytest

from memory_daemon.config import DaemonConfig
from pagedserve.plumbing import settings
from pagedserve.plumbing.auth import SECRET_ENV
from pagedserve.plumbing.settings import nested, positive, setting
from pagedserve.plumbing.sizes import parse_bytes
from services import up
from services.frontend.config import FrontendConfig
from services.worker.config import WorkerConfig


@dataclasses.dataclass(frozen=True)
class Inner:
    depth: int = setting(2, "how deep", check=positive)

    def __post_init__(self) -> None:
        settings.check_settings(self)


@dataclasses.dataclass(frozen=True)
class Example:
    size: int = setting(1024, "a size", convert=parse_bytes)
    mode: Literal["fast", "slow"] = setting("fast", "how")
    page: Literal[8, 16] = setting(16, "a page")
    on: bool = setting(True, "a switch")
    names: tuple[str, ...] = setting(("a",), "repeatable", flag="--name")
    note: str | None = setting(None, "optional")
    inner: Inner = nested(Inner)

    def __post_init__(self) -> None:
        settings.check_settings(self)


def parse(config: type, *argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    settings.add_arguments(parser, config)
    return parser.parse_args(list(argv))


def test_a_flag_per_field_with_its_type_choices_and_default() -> None:
    assert settings.from_args(Example, parse(Example)) == Example()
    args = parse(Example, "--size", "2KiB", "--mode", "slow", "--page", "8", "--no-on", "--name", "x",
                 "--name", "y", "--note", "n", "--depth", "5")  # fmt: skip
    assert settings.from_args(Example, args) == Example(2048, "slow", 8, False, ("x", "y"), "n", Inner(5))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--size", "lots"], "--size: 'lots' is not a size"),
        (["--depth", "0"], "--depth must be positive, got 0"),
    ],
)
def test_a_bad_value_names_its_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        settings.from_args(Example, parse(Example, *argv))


def test_a_worker_refuses_more_torch_threads_than_a_machine_runs() -> None:
    """--threads 100000 would start that many OpenMP threads and take the machine's process ids."""
    with pytest.raises(ValueError, match="--threads must be between 0 and 1024, got 5000"):
        settings.from_args(WorkerConfig, parse(WorkerConfig, "--threads", "5000"))


def test_argparse_refuses_a_value_outside_the_literal(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(Example, "--page", "12")
    assert "invalid choice: 12 (choose from 8, 16)" in capsys.readouterr().err


def test_a_config_built_in_code_obeys_the_same_checks() -> None:
    with pytest.raises(ValueError, match="--mode must be one of fast, slow, got 'medium'"):
        Example(mode="medium")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--page-size must be one of 8, 16, 32, got 12"):
        WorkerConfig(page_size=12)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="--device must be cpu, cuda or cuda:N, got 'gpu'"):
        DaemonConfig(device="gpu")
    with pytest.raises(ValueError, match="--max-batched-tokens must be positive, got 0"):
        settings.from_args(WorkerConfig, parse(WorkerConfig, "--max-batched-tokens", "0"))


def test_the_secret_comes_from_its_file_or_the_environment(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SECRET_ENV, "from-env")
    assert settings.from_args(DaemonConfig, parse(DaemonConfig)).secret == "from-env"
    path = f"{tmp_path}/secret"
    with open(path, "w") as file:
        file.write("from-file\n")
    assert settings.from_args(DaemonConfig, parse(DaemonConfig, "--secret-file", path)).secret == "from-file"
    assert "from-file" not in repr(
        settings.from_args(DaemonConfig, parse(DaemonConfig, "--secret-file", path))
    )


def test_the_dtype_and_device_choices_are_written_once() -> None:
    dtype = next(f for f in settings.settings_of(WorkerConfig) if f.name == "dtype")
    assert settings.choices(dtype.kind) == ("auto", "float32", "float16", "bfloat16")


# `pagedserve up` -----------------------------------------------------------------------------------------


def up_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    return parser


def test_every_child_flag_but_the_managed_ones_is_a_flag_of_up() -> None:
    declared = {option for action in up_parser()._actions for option in action.option_strings}
    for config in (DaemonConfig, WorkerConfig, FrontendConfig):
        for field in settings.settings_of(config):
            assert (field.flag in declared) != (field.flag in up.MANAGED), field.flag


def test_up_passes_each_given_flag_to_the_children_that_have_it() -> None:
    args = up_parser().parse_args(
        ["--workers", "2", "--page-size", "8", "--threads", "1", "--kernels", "torch", "--no-prefix-caching",
         "--device", "cpu", "--max-running", "3", "--max-memory", "2GiB", "--model", "/m",
         "--log-level", "DEBUG"]
    )  # fmt: skip
    plan = up.configure(args)
    assert plan.stack.workers == 2
    assert plan.flags["worker"] == [
        "--model", "/m", "--device", "cpu", "--page-size", "8", "--threads", "1", "--kernels", "torch",
        "--no-prefix-caching",
        "--log-level", "DEBUG",
    ]  # fmt: skip
    assert plan.flags["daemon"] == ["--device", "cpu", "--max-memory", "2GiB", "--log-level", "DEBUG"]
    assert plan.flags["frontend"] == ["--model", "/m", "--max-running", "3", "--log-level", "DEBUG"]
    assert up.configure(up_parser().parse_args([])).flags == {"worker": [], "daemon": [], "frontend": []}


def test_up_shares_the_cores_out_among_cpu_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    assert up.configure(up_parser().parse_args(["--workers", "3"])).flags["worker"] == ["--threads", "2"]
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert up.configure(up_parser().parse_args(["--workers", "2"])).flags["worker"] == ["--threads", "1"]
    for kept in (
        ["--workers", "1"],
        ["--workers", "2", "--threads", "4"],
        ["--workers", "2", "--device", "cuda"],
    ):
        assert up.configure(up_parser().parse_args(kept)).threads_each is None, kept


def test_up_checks_its_childrens_settings_before_starting_any() -> None:
    with pytest.raises(ValueError, match="the CuPy kernels need --device cuda"):
        up.configure(up_parser().parse_args(["--kernels", "cupy"]))
    with pytest.raises(ValueError, match="--watermark is a fraction of the pool"):
        up.configure(up_parser().parse_args(["--watermark", "2"]))


def test_a_pool_narrower_than_its_model_is_passed_on_and_refused_on_cuda() -> None:
    plan = up.configure(up_parser().parse_args(["--dtype", "float32", "--kv-cache-dtype", "bfloat16"]))
    assert plan.flags["worker"][-4:] == ["--dtype", "float32", "--kv-cache-dtype", "bfloat16"]
    with pytest.raises(
        ValueError, match=r"--kv-cache-dtype bfloat16 differs from the model's dtype \(float32\)"
    ):
        up.configure(
            up_parser().parse_args(["--device", "cuda", "--dtype", "float32", "--kv-cache-dtype", "bfloat16"])
        )
    # On CUDA auto is bfloat16, so a bfloat16 pool is the model's own.
    assert WorkerConfig(device="cuda", kv_cache_dtype="bfloat16").kv_cache_dtype == "bfloat16"
    with pytest.raises(SystemExit):  # argparse's usage error: float16 is not a pool the CPU kernels read
        up_parser().parse_args(["--kv-cache-dtype", "float16"])
