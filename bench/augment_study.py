"""Does the job's augmentation help? Final validation accuracy with and without `--augment`, over seeds, on the embedded
digits transfer task (pretrained, the job's defaults; no flips on digits) and on a generated folder of shapes trained
from scratch (circles, squares and triangles of random size, place and colour on noise, 48 px files at --size 32).
Reported as measured, whatever it shows (docs/main_job.md).

    python bench/augment_study.py [--seeds 3] [--epochs 3]"""
import argparse, json, statistics, tempfile, warnings
from pathlib import Path
import numpy as np

def make_shapes(root:Path, n_per_class:int=120, px:int=48, seed:int=0)->Path:
    from PIL import Image, ImageDraw
    r = np.random.default_rng(seed)
    for c in ('circle', 'square', 'triangle'):
        (root/c).mkdir(parents=True, exist_ok=True)
        for i in range(n_per_class):
            img = Image.fromarray(r.integers(0, 90, (px, px, 3), dtype=np.uint8))
            d = ImageDraw.Draw(img)
            s = int(r.integers(px//5, px//2)); x,y = (int(v) for v in r.integers(0, px-s, 2))
            col = tuple(int(v) for v in r.integers(120, 256, 3))
            if c == 'circle': d.ellipse([x, y, x+s, y+s], fill=col)
            elif c == 'square': d.rectangle([x, y, x+s, y+s], fill=col)
            else: d.polygon([(x, y+s), (x+s, y+s), (x+s//2, y)], fill=col)
            img.save(root/c/f'{i}.png')
    return root

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    p.add_argument('--seeds', type=int, default=3)
    p.add_argument('--epochs', type=int, default=3)
    a = p.parse_args(argv)
    warnings.filterwarnings('ignore')
    from accum_finetune.cli import main as job
    tmp = Path(tempfile.mkdtemp(prefix='augment-study-'))
    shapes = make_shapes(tmp/'shapes')
    tasks = {'digits (pretrained)': [], 'shapes (from scratch)': ['--data', str(shapes), '--weights', 'none', '--size', '32']}
    rows = []
    for task,args in tasks.items():
        for aug in ('--no-augment', '--augment'):
            accs = []
            for s in range(a.seeds):
                out = tmp/f'{len(rows)}-{s}'
                assert job([*args, aug, '--seed', str(s), '--epochs', str(a.epochs), '--device', 'cpu', '--out', str(out)]) == 0
                accs.append(json.loads((out/'metrics.json').read_text())['accuracy'])
            rows.append((task, aug, accs))
    print(f"\n| task | augmentation | accuracy (mean ± sd over {a.seeds} seeds) | per seed |\n|---|---|---|---|")
    for task,aug,accs in rows:
        print(f"| {task} | {'on' if aug == '--augment' else 'off'} | {statistics.mean(accs):.4f} ± {statistics.pstdev(accs):.4f} | "
              f"{', '.join(f'{x:.4f}' for x in accs)} |")

if __name__ == '__main__': main()
