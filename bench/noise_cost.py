"""What measuring the gradient noise scale costs (`GradientNoiseScale`) against plain accumulation, side by side in one run.

resnet18 (torchvision, from scratch) at 32 px, micro-batch 8, n_step 4: one Learner fitted in alternating rounds without
and with `GradientNoiseScale()` (`learn.added_cbs`); the ratio of the training times per epoch of each pair of rounds
(mean and 95% interval) is printed, and the
peak of extra tensor memory the measurement keeps (two float64 numbers a window and its log, against the gradient's
size). Goal (issue 28): at most 1.02x, no gradient-sized memory.

    python bench/noise_cost.py [--rounds 9] [--device cpu|cuda] [--threads 1]"""
import time, warnings
import torch, torchvision
from common import images, learner, machine, mean_ci, resnet_args

from accum_callback import GradientAccumulation, GradientNoiseScale

def main(argv=None):
    a = resnet_args(__doc__, 9, argv)
    warnings.filterwarnings('ignore')
    mb,k = 8,4
    ds = images(mb*k*a.windows, 32)
    learn = learner(torchvision.models.resnet18(num_classes=10), ds, mb, cbs=[GradientAccumulation(n_step=k)], device=a.device)
    noise = GradientNoiseScale()
    def epoch(cbs):
        with learn.no_bar(), learn.no_logging(), learn.added_cbs(cbs): learn.fit(1)
        return learn.train_timer.times[-1]
    epoch([]); epoch([noise])   # warm-up
    tp,tm = [],[]
    for i in range(a.rounds):   # each pair in both orders, alternately
        for cbs,ts in (((), tp), ([noise], tm))[::1 if i % 2 else -1]: ts.append(epoch(list(cbs)))
    m,lo,hi = mean_ci([x/y for x,y in zip(tm, tp)])
    # the callback's own time, measured inside it (steadier than the difference of two epochs on a shared machine)
    inside = []
    for ev in ('after_backward', 'before_step'):
        f = getattr(noise, ev)
        def timed(f=f):
            t = time.perf_counter(); f(); inside.append(time.perf_counter()-t)
        setattr(noise, ev, timed)
    t_epoch = epoch([noise])
    for ev in ('after_backward', 'before_step'): delattr(noise, ev)
    grad_bytes = sum(p.numel()*p.element_size() for p in learn.model.parameters())
    kept = sum(t.numel()*t.element_size() for v in noise.log.values() for t in v if isinstance(t, torch.Tensor))
    print(machine())
    print(f"resnet18 32px, micro-batch {mb} x n_step {k}, {a.device}, {a.threads} thread(s): epoch {sorted(tp)[len(tp)//2]:.2f} s "
          f"plain, {sorted(tm)[len(tm)//2]:.2f} s measured (medians); B_simple after the last round {noise.b_simple:.3g}")
    print(f"measured / plain time: {m:.3f} (95% interval {lo:.3f}-{hi:.3f}, {a.rounds} alternating rounds; goal <= 1.02)")
    print(f"inside the callback: {1000*sum(inside)/learn.gradient_accumulation.steps:.2f} ms a window against "
          f"{1000*t_epoch/learn.gradient_accumulation.steps:.0f} ms ({sum(inside)/t_epoch:.4f} of the training time)")
    print(f"memory the measurement keeps: {kept} bytes of logs for {len(noise.log['g2'])} steps "
          f"(the gradient: {grad_bytes/2**20:.1f} MiB; no copy of it is made)")

if __name__ == '__main__': main()
