"""Model names `pdmesh up` accepts and the default dtype per CPU (no model files needed)."""

from __future__ import annotations

import argparse

import pytest

from services.model.catalog import ModelNotFoundError, cpu_default_dtype, resolve_model

INTEL_NO_BF16 = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R)\nflags\t\t: fpu sse avx2 avx512f avx512bw\n"
AMD_BF16 = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"
SPR_AMX = "processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile amx_int8\n"


def test_bf16_only_where_the_cpu_has_it():
    assert cpu_default_dtype(INTEL_NO_BF16) == "float32"
    assert cpu_default_dtype(AMD_BF16) == "bfloat16"
    assert cpu_default_dtype(SPR_AMX) == "bfloat16"
    assert cpu_default_dtype("") == "float32"


def test_builtin_names_and_paths(tmp_path):
    assert resolve_model("builtin-small").preset == "small"
    gguf = tmp_path / "My-Model.Q8_0.gguf"
    gguf.write_bytes(b"")
    choice = resolve_model(str(gguf))
    assert (choice.model_id, choice.model_path, choice.preset) == ("My-Model.Q8_0", str(gguf), None)
    with pytest.raises(ModelNotFoundError, match="builtin-tiny"):
        resolve_model("builtin-huge")


def test_pdmesh_up_model_flags(monkeypatch):
    from pdmesh.commands import model_choice

    def args(**kw):
        return argparse.Namespace(**{"model": None, "preset": None, **kw})

    monkeypatch.setenv("PDMESH_MODEL", "builtin-tiny")
    assert model_choice(args()).preset == "tiny"
    assert model_choice(args(preset="small")).model_id == "builtin-small"
    assert model_choice(args(model="builtin-small")).preset == "small"


def test_pdmesh_up_with_an_unknown_model_is_a_clear_error(capsys, tmp_path):
    from pdmesh.cli import main

    assert main(["up", "--model", str(tmp_path / "missing.gguf"), "--workdir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no such file or folder" in err and "Traceback" not in err
