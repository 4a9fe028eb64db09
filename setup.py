"""The one compiled part of torchlaunch, optional: the training crop's JPEG window decoder
(torchlaunch/worker/data/_jpeg_window.c, against the system's libjpeg-turbo: libjpeg62-turbo-dev on
Debian, libjpeg-turbo8-dev on Ubuntu). Everything else is in pyproject.toml.

Optional because an install without a C compiler, Python's headers or libjpeg-turbo's must still
work: setuptools then says the extension failed to build and installs the rest, and the loader
decodes as before (torchlaunch/worker/data/jpeg.py checks once per process whether the extension
loads and gives the whole decode's pixels)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "torchlaunch.worker.data._jpeg_window",
            ["torchlaunch/worker/data/_jpeg_window.c"],
            libraries=["jpeg"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
