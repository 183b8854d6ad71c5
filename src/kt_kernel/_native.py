"""The compiled build chosen for this CPU, bound once at import (see kt_kernel.loader)."""

from .loader import load_build

build = load_build()
ext = build.module
