"""A part whose dependency is missing exits 2 with one line naming it; a part
not in the build says so; neither prints a traceback."""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import types

import pytest

from kvmesh import cli


class _Loader(importlib.abc.Loader):
    """A part module whose first line imports matplotlib (the replay's plots)."""

    def create_module(self, spec: object) -> None:
        return None

    def exec_module(self, module: types.ModuleType) -> None:
        exec("import matplotlib\ndef main(argv):\n    return 0\n", module.__dict__)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object, target: object = None) -> object:
        if name == "kvmesh_test_part":
            return importlib.util.spec_from_loader(name, _Loader())
        return None


def test_a_missing_dependency_is_named_with_its_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    monkeypatch.setattr(sys, "meta_path", [_Finder(), *sys.meta_path])
    assert cli._run_part("kvmesh_test_part", []) == 2
    err = capsys.readouterr().err
    assert "needs the Python package 'matplotlib'" in err
    assert "pip install 'kvmesh[replay]'" in err
    assert "Traceback" not in err


def test_a_part_not_in_the_build_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli._run_part("lab.no_such_part_here", []) == 2
    assert "is not part of this build" in capsys.readouterr().err
