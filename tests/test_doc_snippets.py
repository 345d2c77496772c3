"""Every Python snippet in README.md and docs/*.md (but docs/api.md, the generated signatures) runs as written, or says
what it needs on the line before it: `<!-- snippet: runs if PACKAGE -->` runs where PACKAGE imports; `<!-- snippet: runs with NAMES -->` runs after `from fastai.vision.all import *`
with the NAMES this file provides (`dls`: 96 of scikit-learn's digits as 1x8x8 images in batches of 8, `model`: the
README quickstart's small BatchNorm net, `learn`: a Learner of both), each in a fresh namespace; `<!-- snippet: needs
... -->` (torchrun, pretrained weights, a download, a GPU), `a sketch` and `a signature` are read, not run: a sketch and
a `needs` snippet must at least compile. `<!-- snippet: runs on an image folder -->` runs in a folder holding
`my_images/` (two classes of small images made here), with `pretrained=False` added to `vision_learner(dls, resnet18,`
(no weights can be downloaded). A snippet with no marker runs as written."""
import re, warnings
from pathlib import Path

import pytest

from doc_outputs import quickstart_code, run_quickstart

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT/'README.md'] + sorted(p for p in (ROOT/'docs').glob('*.md') if p.name != 'api.md')
SNIPPET = re.compile(r'(?:<!-- snippet: ([^>]*?) -->\n)?```python\n(.*?)```', re.S)

def snippets():
    for page in PAGES:
        for i,m in enumerate(SNIPPET.finditer(page.read_text())):
            yield pytest.param(page, m.group(1), m.group(2), id=f'{page.name}-{i}')

def context(names:set)->dict:
    "A fresh namespace: fastai.vision.all's names, and `dls`, `model`, `learn` where the snippet says it runs with them"
    import torch, torch.nn as nn
    from sklearn.datasets import load_digits
    ns = {}
    exec('from fastai.vision.all import *', ns)
    x,y = load_digits(return_X_y=True)
    x,y = torch.tensor(x[:128], dtype=torch.float32).view(-1, 1, 8, 8)/16,torch.tensor(y[:128])
    torch.manual_seed(0)
    dls = ns['DataLoaders'].from_dsets(list(zip(x[:96], y[:96])), list(zip(x[96:], y[96:])), bs=8, device='cpu')
    model = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                          nn.Conv2d(16, 64, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(64*4*4, 10))
    given = dict(dls=dls, model=model)
    if 'learn' in names:
        given['learn'] = ns['Learner'](dls, model, loss_func=ns['CrossEntropyLossFlat'](), metrics=ns['accuracy'])
    unknown = names - set(given)
    assert not unknown, f"the snippet asks for {sorted(unknown)}, which this test does not provide"
    ns.update({k: v for k,v in given.items() if k in names})
    return ns

def image_folder(path, classes=('cat', 'dog'), n:int=10):
    "`path/<class>/<i>.png`: `n` small random RGB images a class, each class of its own mean colour"
    import numpy as np
    from PIL import Image
    rng = np.random.default_rng(0)
    for k,c in enumerate(classes):
        (path/c).mkdir(parents=True)
        for i in range(n):
            a = np.clip(rng.normal(80 + 100*k, 40, (40, 40, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(a).save(path/c/f'{i}.png')

@pytest.mark.parametrize('page,marker,code', list(snippets()))
def test_every_snippet_runs_or_says_what_it_needs(page, marker, code, tmp_path, monkeypatch):
    import matplotlib; matplotlib.use('Agg')
    monkeypatch.chdir(tmp_path)   # (fastai writes models/ where it runs)
    if page.name == 'README.md' and '## Quickstart' in page.read_text() and code == quickstart_code():
        run_quickstart()   # (run once per session, as written: tests/doc_outputs.py compares what it prints too)
        return
    if marker is not None and marker.startswith('runs if '):   # (a package the tests extra has, that the snippet needs)
        pytest.importorskip(marker[len('runs if '):].strip()); marker = None
    if marker == 'runs on an image folder':   # (the README's from_folder: a folder made here, no pretrained download)
        image_folder(tmp_path/'my_images')
        assert 'vision_learner(dls, resnet18,' in code, "the snippet's documented substitution no longer applies"
        code,marker = code.replace('vision_learner(dls, resnet18,', 'vision_learner(dls, resnet18, pretrained=False,'),None
    if marker is None or marker.startswith('runs with'):
        names = set(re.findall(r'\w+', marker[len('runs with'):])) if marker else set()
        ns = context(names) if marker else {}
        with warnings.catch_warnings():
            warnings.simplefilter('ignore')
            exec(compile(code, f'{page.name} snippet', 'exec'), ns)
        return
    assert re.match(r'(needs |a sketch$|a signature$)', marker), f"{page.name}: unknown snippet marker {marker!r}"
    if marker != 'a signature': compile(code, f'{page.name} snippet', 'exec')   # at least Python
