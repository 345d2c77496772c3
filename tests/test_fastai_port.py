"""Coming from fastai (issue 44): a recipe ported by changing one import trains the way its author meant, or says why not.

fastai's `GradientAccumulation(n_acc)` counts samples; ours refuses a count without its name (`n_step=` counts
micro-batches, `target_bs=` items: tests/test_accumulate.py). A recipe's own `from fastai.vision.all import *`
after ours gives fastai's class back under the name: `learn.accumulate(n_acc=...)`, a Learner method no import replaces,
is the migration line that survives it."""
import copy, warnings
import pytest, torch, torch.nn as nn
from fastai.callback.core import Callback
from fastai.callback.fp16 import MixedPrecision

from helpers import as64, flat, floor_tol, make_data, rel_err

RECIPE = '''
from accum_callback import GradientAccumulation
from fastai.vision.all import *            # the recipe's own import, after ours: GradientAccumulation is fastai's again
set_seed(0)
dls = DataLoaders.from_dsets(ds_train, ds_valid, bs=8, device='cpu')
learn = Learner(dls, model, loss_func=MSELossFlat(), opt_func=SGD, lr=0.05, cbs=[spy])
learn.accumulate(n_acc=32)                 # the migration line: ours, whatever was imported after
learn.fit(2)
'''

class StepSpy(Callback):
    """After the accumulation callback (ours or fastai's): at every optimizer step, the gradient of one batch of the
    samples since the last step, from the same weights, against the gradient about to be applied (relative error)"""
    order = MixedPrecision.order-3
    run_valid = False
    def __init__(self, per_fit:bool=True):
        self.buf,self.errs,self.errs64,self.floors,self.sizes,self.per_fit = [],[],[],[],[],per_fit
    def before_fit(self):
        "A window ends with its fit (ours zeroes what it held); fastai's leaves its gradient for the next fit: kept"
        if self.per_fit: self.buf = []
    def after_backward(self): self.buf.append((self.xb, self.yb))
    def before_step(self):
        xb = [torch.cat([b[0][i] for b in self.buf]) for i in range(len(self.xb))]
        yb = [torch.cat([b[1][i] for b in self.buf]) for i in range(len(self.yb))]
        ref = self._grad(copy.deepcopy(self.model), xb, yb)
        ref64 = self._grad(copy.deepcopy(self.model).double(), as64(xb), as64(yb))
        got = flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.model.parameters()])
        self.errs.append(rel_err(got, ref)); self.sizes.append(len(yb[0]))
        self.errs64.append(rel_err(got.double(), ref64)); self.floors.append(rel_err(ref.double(), ref64))
        self.buf = []
    def _grad(self, m, xb, yb):
        m.zero_grad(); self.loss_func(m(*xb), *yb).backward()
        return flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in m.parameters()])
    @property
    def tol(self)->float:
        "The stricter oracle's tolerance: float32's rounding on the one batch, against it in float64 (`floor_tol`)"
        return floor_tol(self.floors)

def test_the_migration_line_survives_the_recipes_star_import():
    from accum_callback.window.accumulate import GradientAccumulation as Ours
    from helpers import MLP
    x,y = make_data(100, seed=2).tensors
    ns = dict(ds_train=list(zip(x[:96], y[:96])), ds_valid=list(zip(x[96:], y[96:])), model=MLP(n_out=3), spy=StepSpy())
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', FutureWarning)
        exec(compile(RECIPE, 'recipe', 'exec'), ns)
    learn = ns['learn']
    assert ns['GradientAccumulation'] is not Ours   # what the star import left under the name
    ga = [cb for cb in learn.cbs if isinstance(cb, (Ours, ns['GradientAccumulation']))]
    assert len(ga) == 1 and isinstance(ga[0], Ours) and ga[0].plan.target_bs() == 32 and ga[0].plan.partial == 'carry'
    spy = ns['spy']
    assert spy.sizes == [32]*6 and max(spy.errs) <= 1e-5, spy.errs   # 96 samples an epoch: 3 steps of 32, exact
    assert max(spy.errs64) <= spy.tol, (spy.errs64, spy.tol)   # the stricter oracle: against float64, float32's own floor

class EvalBN(Callback):
    "BatchNorm on its running statistics in training too, so that the gradient measures the accumulation alone"
    order = 1
    def before_train(self):
        for m in self.model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm): m.eval()

def test_road_to_the_top_ported_both_ways(tmp_path, capsys):
    """Jeremy Howard's "Road to the Top, part 3" shape (course22 notebook 10): `vision_learner` on a timm name, a folder
    of images, `GradientAccumulation(64)` at `bs=64//accum`, `fine_tune`, `tta`, run fastai's way and ours (the one
    line: `learn.accumulate(n_acc=64)`). Printed: steps an epoch and the gradient error of each against one batch of the
    same samples. Here 64 divides by the batch, so fastai's is the large batch too but for its partial windows"""
    import numpy as np
    from PIL import Image
    from fastai.callback.training import GradientAccumulation as FastaiGA
    from fastai.vision.all import ImageDataLoaders, Resize, vision_learner, error_rate, set_seed
    rng = np.random.default_rng(0)
    for c in range(3):
        (tmp_path/f'c{c}').mkdir()
        for i in range(40):
            a = (rng.random((24, 24, 3))*80).astype(np.uint8); a[..., c] += 150
            Image.fromarray(a).save(tmp_path/f'c{c}'/f'{i}.png')
    accum = 4
    def run(ours:bool):
        set_seed(1)
        dls = ImageDataLoaders.from_folder(tmp_path, valid_pct=0.2, seed=42, item_tfms=Resize(16), bs=64//accum, device='cpu')
        spy = StepSpy(per_fit=ours)
        cbs = [] if ours else [FastaiGA(64)]
        # (dropout off in the head: its masks would differ between the micro-batches and the one batch, in both)
        learn = vision_learner(dls, 'resnet18', pretrained=False, metrics=error_rate, ps=0., cbs=cbs + [EvalBN(), spy])
        if ours: learn.accumulate(n_acc=64)
        with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
            warnings.simplefilter('ignore')
            learn.fine_tune(1, 1e-2, freeze_epochs=1)
            preds,_ = learn.tta(n=2)
        return spy,preds,len(dls.train)
    (fa,fa_preds,nb),(us,us_preds,_) = run(False),run(True)
    print(f"\nRoad to the Top shape, {nb} loader batches of {64//accum} an epoch, n_acc=64, 2 fits (frozen, unfrozen):")
    print(f"  fastai's GradientAccumulation(64): {len(fa.errs)} steps, gradient error up to {max(fa.errs):.1e} (windows {fa.sizes})")
    print(f"  learn.accumulate(n_acc=64):        {len(us.errs)} steps, gradient error up to {max(us.errs):.1e} (windows {us.sizes})")
    assert max(us.errs) <= 1e-5, us.errs
    assert max(us.errs64) <= us.tol, (us.errs64, us.tol)   # the stricter oracle: against float64, float32's own floor
    assert fa_preds.shape == us_preds.shape and torch.isfinite(us_preds).all()
    # n_acc carries a window over epochs as fastai does, and a fit's last partial window is dropped with its gradient:
    # every step of ours is 64 samples from one set of weights. fastai's leaves that gradient in `.grad`, and the
    # unfrozen fit's first step applies it with its own (a window of 96 samples from two fits: measured 0.31 off)
    assert us.sizes == [64, 64] and len(fa.errs) == len(us.errs) and fa.sizes[1] > 64 and max(fa.errs) > 1e-2
    assert capsys.readouterr().out.count('steps, gradient error') == 2
