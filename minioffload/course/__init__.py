"""The course layer: what the book and the labs use around the runtime, and nothing the runtime needs.

`check` (lab graders and chapter check cells), `viz` (figures), `widgets` (interactive wrappers over the
figures) and `instrument` (per-phase readings of a device's trace and ledger for chapter 5).

What this is not: part of the runtime. No module of `minioffload` outside this package imports it, so the
runtime runs with torch, NumPy, Numba and xxhash alone. This package needs the `course` extra
(`pip install -e ".[course]"`: matplotlib, ipywidgets, tqdm). Import its modules by name
(`from minioffload.course import check, viz`); importing this package alone imports none of them.
"""
