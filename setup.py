"""Package layout: the repository's five layer folders install as one ``closedloop`` namespace.

``sdk/``, ``runtime/``, ``firmware_bridge/``, ``export/`` and ``sim/`` stay at the top of the
repository; installed they become ``closedloop.sdk``, ``closedloop.runtime``, ... Everything
else about the distribution is in pyproject.toml.
"""

from setuptools import find_packages, setup

LAYERS = ("sdk", "runtime", "firmware_bridge", "export", "sim")

packages = ["closedloop"] + find_packages(include=["closedloop.*"])
for layer in LAYERS:
    packages += [f"closedloop.{layer}"] + [f"closedloop.{layer}.{p}" for p in find_packages(layer)]

setup(
    packages=packages,
    package_dir={"closedloop": "closedloop", **{f"closedloop.{layer}": layer for layer in LAYERS}},
)
