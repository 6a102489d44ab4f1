"""`mlakit models`: the presets, and for every transformers family whether it is served and why not."""

from __future__ import annotations

import json

import pytest

from mlakit.cli import main
from mlakit.hf.families import DSA_REASON


def _families(capsys) -> dict[str, dict]:
    assert main(["models", "--json"]) == 0
    return {f["attention"]: f for f in json.loads(capsys.readouterr().out)["families"]}


def test_dsa_families_say_what_is_missing_beside_the_served_indexer(capsys):
    fams = _families(capsys)
    assert fams["DeepseekV32Attention"]["patched"] and fams["GlmMoeDsaAttention"]["patched"]
    dsa = {name: f for name, f in fams.items() if (f["reason"] or "").startswith(DSA_REASON)}
    assert {"AXK2Attention", "HYV4Attention", "Glm5NextTextAttention", "MistralLarge4TextAttention"} <= set(
        dsa
    )
    for name, f in dsa.items():
        rest = f["reason"].removeprefix(DSA_REASON).strip()
        assert len(rest) > 10, name  # the family's own missing piece, not "sparse attention"
        assert "sparse attention not supported" not in f["reason"]


@pytest.mark.parametrize(
    "attention,names",
    [
        ("AXK2Attention", "q_gate_proj"),
        ("HYV4Attention", "attention sinks"),
        ("MistralLarge4TextAttention", "kv_sharing_modes"),
        ("Dots3NoteTextAttention", "sliding-window"),
        ("Glm5NextTextAttention", "zero rope width"),
    ],
    ids=["axk2", "hy_v4", "mistral_large4", "dots3", "glm5_next"],
)
def test_each_refused_family_names_its_reason_in_the_table(attention, names, capsys):
    assert main(["models"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if f" {attention} " in x)
    assert line.split()[2] == "no:" and names in line and "DSA indexer served" in line
