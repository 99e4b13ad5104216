"""On the PYTHONPATH of the tests' processes when HARNESS_TEST_LAUNCHES names a log: each cold interpreter logs
itself there (launches.py), then runs the next sitecustomize on the path, if any, as Python would have."""
import os
import sys

if os.environ.get("HARNESS_TEST_LAUNCHES"):
    import launches

    launches.record("cold", None)
_here = os.path.dirname(os.path.abspath(__file__))
for _entry in sys.path:
    _path = os.path.join(_entry or ".", "sitecustomize.py")
    if os.path.abspath(_entry or ".") != _here and os.path.isfile(_path):
        with open(_path) as _f:
            exec(compile(_f.read(), _path, "exec"), {"__name__": "sitecustomize", "__file__": _path})
        break
