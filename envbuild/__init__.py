"""envbuild: reproducible GPU training images with pre-built DeepSpeed ops."""

__version__ = "0.1.0"
