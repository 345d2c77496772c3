"""One training run, timed as a whole process to compare two checkouts side by side (A B A B ..., PYTHONPATH picks the
checkout): a small BatchNorm conv net on 512 random 32px images, micro-batch 16 x 8, 3 epochs, one thread.

    PYTHONPATH=/path/to/checkout python bench/train_once.py"""
import sys, time, warnings; warnings.filterwarnings('ignore')
import torch; torch.set_num_threads(1)
sys.path.insert(0, __import__('os').path.dirname(__import__('os').path.abspath(__file__)))
from common import conv_net, images, learner
from accum_callback import GradientAccumulation
ds = images(512, 32)
learn = learner(conv_net(), ds, 16, cbs=[GradientAccumulation(n_step=8)])
with learn.no_bar(), learn.no_logging(): learn.fit(3)
