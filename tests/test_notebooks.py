"Execute every notebook in nbs/ with nbclient, in a temporary working directory (tiny settings: no env flags set)"
from pathlib import Path

import pytest

nbformat = pytest.importorskip('nbformat')
nbclient = pytest.importorskip('nbclient')

NBS = sorted((Path(__file__).resolve().parents[1]/'nbs').glob('*.ipynb'))

@pytest.mark.parametrize('nb', NBS, ids=[p.name for p in NBS])
def test_notebook(nb, tmp_path, cache, monkeypatch):
    for flag in ('ACCUM_STUDY_FULL', 'ACCUM_NB_FULL'): monkeypatch.delenv(flag, raising=False)   # the tiny settings
    book = nbformat.read(nb, as_version=4)
    nbclient.NotebookClient(book, timeout=600, kernel_name='python3', resources={'metadata': {'path': str(tmp_path)}}).execute()
