"The README's quickstart runs as written, offline, given a `dls` (built here from a generated image folder)"
import re, warnings
from pathlib import Path

import numpy as np
from PIL import Image

README = Path(__file__).resolve().parents[1]/'README.md'

def quickstart_code()->str:
    text = README.read_text()
    section = text[text.index('## Quickstart'):]
    return re.search(r'```python\n(.*?)```', section, re.S).group(1)

def test_quickstart_runs_offline(tmp_path, monkeypatch):
    code = quickstart_code()
    assert 'pretrained=False' in code and 'GradientAccumulation(n_step=8)' in code
    r = np.random.default_rng(0)
    for k in range(2):
        (tmp_path/f'c{k}').mkdir()
        for i in range(20):
            a = (r.random((32, 32, 3))*80).astype(np.uint8); a[..., k] += 150
            Image.fromarray(a).save(tmp_path/f'c{k}'/f'{i}.png')
    monkeypatch.chdir(tmp_path)
    import matplotlib; matplotlib.use('Agg')
    from fastai.vision.all import ImageDataLoaders, Resize
    dls = ImageDataLoaders.from_folder(tmp_path, valid_pct=0.2, seed=0, bs=4, item_tfms=Resize(32), num_workers=0, device='cpu')
    ns = dict(dls=dls)
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        exec(compile(code, 'README quickstart', 'exec'), ns)
    learn = ns['learn']
    ga = learn.gradient_accumulation
    # 32 training images, micro-batch 4, n_step 8: one window an epoch; fine_tune(3) = 1 frozen + 3 unfrozen epochs,
    # and the logs are those of the last fit
    assert ga.steps == 3 and ga.window_sizes == [32]*3 and learn.model[0][1].num_batches_tracked > 0 and learn.model[0][1].momentum == 0.1
