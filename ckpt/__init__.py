"""ckpt: checkpoint and restore running Linux process trees with CRIU."""

__version__ = "0.1.0"
