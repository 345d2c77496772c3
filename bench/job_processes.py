"""The job on 1 and on N processes at the same global batch, side by side: time per epoch and accuracy (issue 45).

    python bench/job_processes.py [--nproc 2] [--device cpu|cuda] [--epochs 3] [--seeds 0 1 2] [job options...]

Each run is `python -m accum_callback` (1 process) or `torchrun --nproc-per-node N -m accum_callback` (N processes;
gloo on CPUs, NCCL on GPUs), with `--loader-bs 4 --effective-bs 32` unless given; the table is printed as markdown.
On a GPU machine give `--device cuda --nproc <GPUs>`."""
import argparse, json, os, statistics, subprocess, sys, tempfile, time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

def job(nproc:int, out:Path, seed:int, args:list)->dict:
    launch = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc-per-node', str(nproc)] if nproc > 1 else [sys.executable]
    cmd = launch + ['-m', 'accum_callback', '--out', str(out), '--seed', str(seed), *args]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    if r.returncode: raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    m = json.loads((out/'metrics.json').read_text())
    m['wall'] = time.perf_counter() - t0
    return m

def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument('--nproc', type=int, default=2); p.add_argument('--device', default='cpu')
    p.add_argument('--epochs', type=int, default=3); p.add_argument('--seeds', type=int, nargs='+', default=[0, 1, 2])
    a,rest = p.parse_known_args()
    if '--loader-bs' not in rest: rest += ['--loader-bs', '4']
    if '--effective-bs' not in rest: rest += ['--effective-bs', '32']
    rest += ['--device', a.device, '--epochs', str(a.epochs), '--checkpoint-minutes', '0']
    rows = {1: [], a.nproc: []}
    with tempfile.TemporaryDirectory() as d:
        for seed in a.seeds:
            for n in (1, a.nproc) if seed % 2 == 0 else (a.nproc, 1):   # alternating which goes first
                rows[n].append(job(n, Path(d)/f'{n}-{seed}', seed, rest))
    print(f"| processes | global batch | time per epoch (s), median | accuracy, mean (per seed) | optimizer steps |")
    print("|---|---|---|---|---|")
    for n,ms in rows.items():
        per_epoch = statistics.median(m['train_seconds']/m['epochs'] for m in ms)
        accs = [m['accuracy'] for m in ms]
        print(f"| {n} | {ms[0]['effective_bs']} ({ms[0]['loader_bs']} x {ms[0]['n_step']} x {n}) | {per_epoch:.2f} | "
              f"{statistics.mean(accs):.4f} ({', '.join(f'{x:.4f}' for x in accs)}) | {ms[0]['optimizer_steps']} |")
    print(f"\n{ms[0]['device']}, {len(a.seeds)} seeds, {a.epochs} epochs; job options: {' '.join(rest)}")

if __name__ == '__main__': main()
