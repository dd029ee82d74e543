"""kvxfer bench: option parsing, sweeps and presets (no timing here)."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from kvxfer.bench import cli
from kvxfer.bench.cases import devices_missing
from kvxfer.bench.config import (
    PRESETS,
    ConfigError,
    LatencySweep,
    Point,
    ThroughputSweep,
    devices_argument,
    format_size,
    parse_ints,
    parse_size,
    parse_sizes,
    preset,
)
from kvxfer.bench.runner import plan, run


@pytest.mark.parametrize("text,expected", [
    ("4K", 4096), ("64KiB", 65536), ("1M", 1 << 20), ("1g", 1 << 30), ("4096", 4096), ("1.5K", 1536), (512, 512),
])
def test_parse_size_reads_binary_units(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "4X", "-4K", "0", "1.3K", "K"])
def test_parse_size_names_the_option_on_bad_input(text: str) -> None:
    with pytest.raises(ConfigError, match="--row-sizes"):
        parse_size(text, "--row-sizes")


def test_lists_and_format() -> None:
    assert parse_sizes("4K, 64K,1M", "x") == (4096, 65536, 1 << 20)
    assert parse_ints("1k,100", "rows") == (1024, 100)
    assert format_size(64 << 10) == "64 KiB" and format_size(3 << 30) == "3 GiB" and format_size(100) == "100 B"
    with pytest.raises(ConfigError, match="empty"):
        parse_sizes(" , ", "x")


def test_sweep_derives_rows_from_request_bytes() -> None:
    sweep = ThroughputSweep(row_bytes=(4096, 1 << 20), request_bytes=8 << 20, groups=(1, 2), slots=("scattered",))
    points = sweep.points()
    assert {(p.row_bytes, p.groups, p.rows) for p in points} == {
        (4096, 1, 2048), (4096, 2, 1024), (1 << 20, 1, 8), (1 << 20, 2, 4)}
    assert all(p.total_bytes == 8 << 20 for p in points)


def test_sweep_product_with_explicit_rows() -> None:
    sweep = ThroughputSweep(row_bytes=(4096,), rows=(1, 32), directions=("push", "pull"),
                            slots=("contiguous", "scattered"))
    assert len(sweep.points()) == 2 * 2 * 2


@pytest.mark.parametrize("kwargs,what", [
    ({"directions": ("sideways",)}, "directions"),
    ({"memory": ("disk",)}, "memory"),
    ({"slots": ("contiguous", "contiguous")}, "twice"),
    ({"groups": (0,)}, "positive"),
])
def test_sweep_refuses_bad_dimensions(kwargs: dict, what: str) -> None:
    with pytest.raises(ConfigError, match=what):
        ThroughputSweep(row_bytes=(4096,), **kwargs)


def test_latency_sweep_validates_samples() -> None:
    with pytest.raises(ConfigError, match="samples"):
        LatencySweep(samples=1)


@pytest.mark.parametrize("name", PRESETS, ids=[f"preset_{p}" for p in PRESETS])
def test_presets_are_valid_and_plan(name: str) -> None:
    cfg = preset(name)
    items = plan(cfg)
    assert items, name
    assert {i.spec.name for i in items} <= set(cfg.cases)


def test_gpu_preset_covers_issue_5_figures() -> None:
    cfg = preset("gpu")
    points = cfg.throughput_points()
    device = [p for p in points if p.memory == "device"]
    for row in (4096, 16384, 65536):
        for total in (256 << 20, 1 << 30):
            assert any(p.row_bytes == row and p.total_bytes == total and p.slots == "scattered" for p in device)
    assert cfg.latency is not None and 32 in cfg.latency.rows and "device" in cfg.latency.memory
    # issue 5's list: device copy, NIXL per row and one descriptor, NIXL packed, the IPC kernel
    # (and the IPC backend end to end), all with the peer in a second process
    assert {"local_copy", "nixl_one_desc", "nixl_per_row", "nixl_2p_packed", "ipc_kernel", "ipc"} <= set(cfg.cases)
    assert cfg.cases.index("ipc") < cfg.cases.index("nixl_per_row")  # a time limit cuts NIXL's slow tail first
    assert not {"nixl", "nixl_packed"} & set(cfg.cases)  # one-process NIXL on device: a 0.36 GB/s lane


def test_unknown_preset_and_case_are_named() -> None:
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        preset("huge")
    with pytest.raises(ConfigError, match="unknown case"):
        plan(preset("tiny").with_cases(["warp_drive"]))


def test_reference_cases_are_planned_once_per_key() -> None:
    cfg = preset("tiny").with_cases(["local_copy"])
    items = plan(cfg)
    # two row sizes x two slot patterns, but local_copy varies only with memory and total bytes
    assert len(items) == len({p.total_bytes for p in cfg.throughput_points()})


def test_cli_flags_replace_the_throughput_sweep() -> None:
    args = cli.build_parser().parse_args(
        ["--preset", "tiny", "--row-sizes", "4K,16K", "--rows", "3", "--slots", "scattered", "--directions", "pull",
         "--reps", "4", "--no-latency", "--overhead-rows", "10", "--cases", "loopback"])
    cfg = cli.config_from_args(args)
    assert cfg.cases == ("loopback",)
    assert cfg.throughput_points() == [Point("pull", "host", "scattered", 4096, 3, 1),
                                       Point("pull", "host", "scattered", 16384, 3, 1)]
    assert cfg.latency is None and cfg.overhead is not None and cfg.overhead.rows == (10,)
    assert cfg.repetition.reps == 4


def test_cli_bad_option_exits_2_with_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--preset", "tiny", "--row-sizes", "4Q"]) == 2
    assert "--row-sizes" in capsys.readouterr().err


@pytest.mark.parametrize("text,expected", [("0,1", (0, 1)), ("1,0", (1, 0)), ("2", (2, 2)), (" 0 , 3 ", (0, 3))])
def test_devices_read_as_prefill_then_decode(text: str, expected: tuple[int, int]) -> None:
    args = cli.build_parser().parse_args(["--preset", "tiny", "--devices", text])
    cfg = cli.config_from_args(args)
    assert cfg.devices == expected
    assert (cfg.prefill_device, cfg.decode_device) == expected
    assert cfg.two_devices is (expected[0] != expected[1])
    # the active end holds the source for a push (prefill) and the destination for a pull (decode)
    assert cfg.active_devices("push") == expected and cfg.active_devices("pull") == expected[::-1]


@pytest.mark.parametrize("text", ["0,1,2", "a,1", "-1,0", "0;1", ",", ",1", "1,", "0,,1", "\u00b2,0"])
def test_bad_devices_exit_2_naming_the_flag(text: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--preset", "tiny", f"--devices={text}"]) == 2
    assert "--devices" in capsys.readouterr().err


def test_the_scripts_devices_argument_reads_and_refuses_like_the_cli() -> None:
    assert devices_argument("0,1") == (0, 1) and devices_argument("3") == (3, 3)
    with pytest.raises(argparse.ArgumentTypeError, match="'1,' must be one or two CUDA device indices"):
        devices_argument("1,")


def test_devices_are_validated_on_the_config_itself() -> None:
    with pytest.raises(ConfigError, match="devices"):
        dataclasses.replace(preset("tiny"), devices=(0, -1))
    with pytest.raises(ConfigError, match="devices"):
        dataclasses.replace(preset("tiny"), devices=(0,))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="devices"):
        dataclasses.replace(preset("tiny"), devices=(True, 0))
    listed = dataclasses.replace(preset("tiny"), devices=[0, 1])  # type: ignore[arg-type]
    assert listed.devices == (0, 1) and hash(listed.devices)  # a tuple, fit to key a shared pair


def test_gpu2_preset_covers_issue_8_figures() -> None:
    cfg = preset("gpu2")
    assert cfg.devices == (0, 1) and cfg.two_devices
    device = [p for p in cfg.throughput_points() if p.memory == "device"]
    for row in (4096, 16384, 65536):
        for total in (256 << 20, 1 << 30):
            assert any(p.row_bytes == row and p.total_bytes == total and p.slots == "scattered" for p in device)
    # the peer copy (reference), NIXL one descriptor / per row / packed, the IPC backend and its kernel
    assert {"local_copy", "nixl_one_desc", "nixl_per_row", "nixl_2p_packed", "ipc", "ipc_kernel"} <= set(cfg.cases)
    assert cfg.cases.index("ipc") < cfg.cases.index("nixl_per_row")  # a time limit cuts NIXL's slow tail first


def test_device_figures_on_a_machine_without_cuda_are_skipped_with_the_reason() -> None:
    if devices_missing(preset("gpu2")) is None:
        pytest.skip("this machine has the two CUDA devices: the skip path is for machines without them")
    cfg = dataclasses.replace(preset("tiny"), cases=("local_copy",), throughput=(
        ThroughputSweep(row_bytes=(4096,), rows=(4,), memory=("device",), slots=("contiguous",)),), latency=None,
        overhead=None, devices=(0, 1))
    result = run(cfg)
    (figure,) = result.figures
    assert figure.status == "skipped" and figure.reason.startswith("device memory:")


def test_latency_settle_time_is_validated_and_read_from_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="settle"):
        LatencySweep(settle_us=-1)
    args = cli.build_parser().parse_args(["--preset", "tiny", "--latency-settle-us", "1500"])
    cfg = cli.config_from_args(args)
    assert cfg.latency is not None and cfg.latency.settle_us == 1500
    assert cli.config_from_args(cli.build_parser().parse_args(["--preset", "tiny"])).latency.settle_us == 0


def test_cli_memory_flag_limits_the_latency_sweep_too() -> None:
    """``--memory device`` on the gpu preset used to leave the latency sweep's host points in
    (run, or reported skipped, beside the device ones)."""
    assert preset("gpu").latency is not None and "host" in preset("gpu").latency.memory
    cfg = cli.config_from_args(cli.build_parser().parse_args(["--preset", "gpu", "--memory", "device"]))
    assert cfg.latency is not None and cfg.latency.memory == ("device",)
    assert {p.memory for p in cfg.latency.points()} == {"device"}
    with pytest.raises(ConfigError, match="disk"):
        cli.config_from_args(cli.build_parser().parse_args(["--preset", "gpu", "--memory", "disk"]))


def test_cli_memory_flag_applies_to_a_latency_sweep_the_flags_create() -> None:
    args = cli.build_parser().parse_args(["--preset", "gpu", "--no-latency"])
    assert cli.config_from_args(args).latency is None
    args = cli.build_parser().parse_args(["--preset", "tiny", "--memory", "device", "--latency-rows", "32"])
    cfg = cli.config_from_args(args)
    assert cfg.latency is not None and cfg.latency.memory == ("device",) and cfg.latency.rows == (32,)
