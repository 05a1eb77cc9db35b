"""The wheel installs everything under `lathe.` and nothing generic at the top level."""

import sys
import zipfile
from pathlib import Path

import pytest

from tests import processes

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("model", "data", "pretrain", "posttrain", "serve", "kernels")


@pytest.mark.slow
def test_wheel_maps_each_folder_under_the_lathe_namespace(tmp_path):
    processes.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                   "-q", "-w", str(tmp_path), str(ROOT)], timeout=300)
    (wheel,) = tmp_path.glob("lathe-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names}
    assert top_level == {"lathe", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1]
                         + ".dist-info"}
    for package in PACKAGES:
        for init in (ROOT / package).rglob("__init__.py"):  # subpackages too
            assert f"lathe/{init.relative_to(ROOT).as_posix()}" in names
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names
                                                    if n.endswith("entry_points.txt")))
    assert b"lathe = lathe.core.cli:main" in entry_points
