"""notebooks/quickstart.ipynb executes top to bottom (nbclient, a fresh kernel of this Python).

It runs against the real shipped pair in jspec/assets/standin when it is present (the CI case
once the trained pair is committed), otherwise against a tiny random pack built by the fixture
(tests/standin_pack.py), so the notebook's code is proven either way. The stand-in cache lives in
pytest's temporary directory (shared with tests/test_standin.py's demo test). With
JSPEC_WRITE_NOTEBOOK=1 the executed notebook, outputs included, is written back (do that with the
shipped pair only).
"""

import json
import os
import sys
from pathlib import Path

import pytest

from standin_pack import standin_env

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook(tmp_path_factory, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    # A kernel spec for exactly this interpreter (not whatever `python` is on PATH).
    spec = tmp_path / "jupyter" / "kernels" / "jspec-test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "jspec test", "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    base = tmp_path_factory.getbasetemp() / "standin-demo"
    with standin_env(base) as (pack_dir, shipped):
        print(f"notebook against {'the shipped pair' if shipped else 'a tiny random pack'} ({pack_dir})")
        nb = nbformat.read(NOTEBOOK, as_version=4)
        client = nbclient.NotebookClient(nb, kernel_name="jspec-test", timeout=600,
                                         resources={"metadata": {"path": str(NOTEBOOK.parents[1])}})
        client.execute()
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                     for o in c.get("outputs", []))
    assert "greedy outputs identical" in text and "tokens per verify step" in text
    if shipped and os.environ.get("JSPEC_WRITE_NOTEBOOK") == "1":
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                     "language": "python"}
        for cell in nb.cells:
            cell.metadata.pop("execution", None)  # timestamps: noise in the diff
        nbformat.write(nb, NOTEBOOK)
