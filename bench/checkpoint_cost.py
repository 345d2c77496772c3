"""What a checkpoint costs (issue 37): the time to write one and its size, for the job's model and for resnet50 (with
Adam's state and a window's gradients, as `Checkpoint` saves them), and the training time with checkpoints against
without, side by side in alternating rounds: at the default cadence (every 5 minutes: none in a short run, so the cost
is the bookkeeping) and every optimizer step.

    python bench/checkpoint_cost.py [--rounds 7]"""
import argparse, statistics, sys, tempfile, time, warnings
from pathlib import Path

import torch, torch.nn as nn
warnings.filterwarnings('ignore')
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import conv_net, images, learner, machine

from accum_callback import Checkpoint, GradientAccumulation
from accum_callback.checkpoint import _write, read_checkpoint

def one_write(model, d:Path, repeats:int=5):
    "Median seconds to write and to read a checkpoint of `model` (weights, gradients, Adam's two moments), and its bytes"
    from fastai.optimizer import Adam
    for p in model.parameters(): p.grad = torch.randn_like(p)
    opt = Adam(list(model.parameters()), lr=1e-3)
    for p in model.parameters(): opt.state[p] = dict(grad_avg=torch.randn_like(p), sqr_avg=torch.rand_like(p), step=1)
    state = dict(model=model.state_dict(), grads=[p.grad for p in model.parameters()], opt=opt.state_dict())
    w,r = [],[]
    for i in range(repeats):
        f = d/f'c{i}.pt'
        t0 = time.perf_counter(); n = _write(f, state); w.append(time.perf_counter()-t0)
        t0 = time.perf_counter(); read_checkpoint(f); r.append(time.perf_counter()-t0)
        f.unlink()
    return statistics.median(w),statistics.median(r),n

def train_ratio(rounds:int, d:Path):
    "Median of per-round ratios (with checkpoints / without) of a small conv net's fit, and their spread"
    ds = images(512, 32)
    def fit(extra):
        learn = learner(conv_net(), ds, 16, cbs=[GradientAccumulation(n_step=4)] + extra)
        t0 = time.perf_counter()
        with learn.no_bar(), learn.no_logging(): learn.fit(2)
        return time.perf_counter()-t0
    kinds = dict(plain=lambda: [], minutes5=lambda: [Checkpoint(d/'m5', minutes=5, epoch_end=False, resume=False)],
                 every_step=lambda: [Checkpoint(d/'e1', every=1, epoch_end=False, resume=False)])
    fit([])   # warm-up
    times = {k: [] for k in kinds}
    for r in range(rounds):
        order = list(kinds)[r % 3:] + list(kinds)[:r % 3]
        for k in order: times[k].append(fit(kinds[k]()))
    out = {}
    for k in ('minutes5', 'every_step'):
        ratios = [a/b for a,b in zip(times[k], times['plain'])]
        med = statistics.median(ratios)
        out[k] = (med, 1.4826*statistics.median([abs(x-med) for x in ratios]), statistics.median(times[k]))
    return out, statistics.median(times['plain'])

def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--rounds', type=int, default=7)
    a = p.parse_args()
    torch.set_num_threads(1)
    print(machine())
    from accum_finetune.models import DEFAULT_ARCH, create_model
    from torchvision.models import resnet50
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        for name,m in ((f'the job\'s model ({DEFAULT_ARCH})', create_model(DEFAULT_ARCH, 10)), ('resnet50', resnet50(weights=None))):
            w,r,n = one_write(m, d)
            print(f"{name}: {sum(p.numel() for p in m.parameters())/1e6:.2f}M parameters, checkpoint {n/2**20:.1f} MiB, "
                  f"written in {w:.3f} s, read and checked in {r:.3f} s (medians of 5)")
        res,plain = train_ratio(a.rounds, d)
        print(f"training, conv net 32px, micro-batch 16 x 4, 2 epochs of 512 images: {plain:.2f} s without checkpoints (median)")
        for k,label in (('minutes5', 'every 5 minutes (the default cadence; none fall due in the run)'), ('every_step', 'every optimizer step')):
            med,spread,t = res[k]
            print(f"with checkpoints {label}: {med:.3f} ± {spread:.3f} of the time without ({a.rounds} alternating rounds)")

if __name__ == '__main__': main()
