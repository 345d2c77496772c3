"""What `learn.check_accumulation()` costs against one training window, side by side in one run.

resnet18 (torchvision, from scratch) at 32 px, micro-batch 8, n_step 4: the window's time is a fit's training time per
optimizer step (fastai's loop, GradientAccumulation, SGD), the check's the wall time of `learn.check_accumulation()`
(which finds 'batchnorm' here, so it runs its experiments too). Rounds alternate the two; the ratio's mean and 95%
interval are printed. Goal (issue 21): at most 3x.

    python bench/check_cost.py [--rounds 7] [--device cpu|cuda] [--threads 1]"""
import time, warnings
import torch, torchvision
from common import images, learner, machine, mean_ci, resnet_args

from accum_callback import GradientAccumulation, BatchNormAccumulation

def main(argv=None):
    a = resnet_args(__doc__, 7, argv, lambda p: p.add_argument('--bn', default=None, help="a BatchNormAccumulation mode on the Learner (default none)"))
    warnings.filterwarnings('ignore')
    mb,k = 8,4
    ds = images(mb*k*a.windows, 32)
    model = torchvision.models.resnet18(num_classes=10)
    cbs = [GradientAccumulation(n_step=k)] + ([BatchNormAccumulation(a.bn)] if a.bn else [])
    learn = learner(model, ds, mb, cbs=cbs, device=a.device)
    with learn.no_bar(), learn.no_logging(): learn.fit(1)   # warm-up (and the optimizer exists)
    learn.check_accumulation()
    sync = (lambda: torch.cuda.synchronize()) if a.device.startswith('cuda') else (lambda: None)
    win,chk = [],[]
    for _ in range(a.rounds):
        with learn.no_bar(), learn.no_logging(): learn.fit(1)
        win.append(learn.train_timer.times[-1]/learn.gradient_accumulation.steps)
        sync(); t = time.perf_counter(); r = learn.check_accumulation(); sync(); chk.append(time.perf_counter()-t)
    ratios = [c/w for c,w in zip(chk, win)]
    m,lo,hi = mean_ci(ratios)
    print(machine())
    print(f"resnet18 32px, micro-batch {mb} x n_step {k}, {a.device}, {a.threads} thread(s), bn={a.bn}: "
          f"window {1000*sorted(win)[len(win)//2]:.1f} ms, check {1000*sorted(chk)[len(chk)//2]:.1f} ms (medians)")
    print(f"check / window: {m:.2f} (95% interval {lo:.2f}-{hi:.2f}, {a.rounds} alternating rounds); verdict: "
          f"{'exact' if r.exact else 'not exact'}, causes {r.causes}")

if __name__ == '__main__': main()
