"""What the recommended callbacks add to plain accumulation on small models, where a fixed cost per micro-batch or per
window shows most (issue 38): `BatchNormAccumulation('pool')` and `GradientNoiseScale()`, side by side in one run.

The bars' small conv net (bench/bench.py's `conv_net`: four conv + BatchNorm blocks), micro-batch 16 x n_step 8,
`--windows` optimizer steps an epoch, SGD: one Learner per contender (plain accumulation, + 'pool', + the noise scale),
each fitted for one epoch per round, the order rotating every round after a warm-up round. Printed: the median of the
per-round ratios to plain accumulation ± 1.4826 x MAD (goals: 'pool' <= 1.03, noise <= 1.02), and what each adds per
window in microseconds (median over rounds of its epoch minus plain's, over the windows), with the machine.

    python bench/overhead.py [--rounds 9] [--windows 8] [--width 32] [--threads 1]"""
import argparse, statistics, warnings
from functools import partial

warnings.filterwarnings('ignore')
import torch
from common import conv_net, fit_time, images, learner, machine, rounds, summary, table, time_row

from accum_callback import BatchNormAccumulation, GradientAccumulation, GradientNoiseScale

GOALS = {'pool': 1.03, 'noise': 1.02}

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--rounds', type=int, default=9)
    p.add_argument('--windows', type=int, default=8, help='optimizer steps an epoch (default 8)')
    p.add_argument('--width', type=int, default=32, help="the conv net's first channels (default 32, the bars')")
    p.add_argument('--b', type=int, default=16); p.add_argument('--k', type=int, default=8)
    p.add_argument('--threads', type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    ds = images(a.b*a.k*a.windows, 32)
    def make(cbs): return partial(fit_time, learner(conv_net(a.width), ds, a.b, [GradientAccumulation(n_step=a.k), *cbs]))
    contenders = {'plain': make([]), 'pool': make([BatchNormAccumulation('pool')]), 'noise': make([GradientNoiseScale()])}
    t,errs = rounds(contenders, a.rounds)
    if errs: raise RuntimeError(errs)
    rows,per_window = [],{}
    for n,name in (('pool', "`BatchNormAccumulation('pool')`"), ('noise', '`GradientNoiseScale()`')):
        rows.append(time_row(f'time/epoch: {name} / plain accumulation', t[n], t['plain'], GOALS[n]))
        per_window[n] = summary([1e6*(x - y)/a.windows for x,y in zip(t[n], t['plain'])])
    print(machine())
    print(f"conv_net(width={a.width}) 32 px, micro-batch {a.b} x n_step {a.k}, {a.windows} windows an epoch, "
          f"{a.threads} thread(s), {a.rounds} rounds (+1 warm-up), order rotating")
    print(table(rows))
    print('- added per window (µs, median ± spread): ' + ', '.join(f'{n} {m:.0f} ± {s:.0f}' for n,(m,s) in per_window.items()))
    print('- medians (s/epoch ± spread): ' + ', '.join(f'{n} {summary(v)[0]:.3f} ± {summary(v)[1]:.3f}' for n,v in t.items()))

if __name__ == '__main__': main()
