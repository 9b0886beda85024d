"""Maps the namespace package `phasefleet`, split over two source roots, for setuptools.

`operator/` holds the control plane's part (api, operator, autoscale) and `runtime_image/`
the engine image's part; pyproject.toml holds everything else.
"""

from setuptools import find_namespace_packages, setup

ROOTS = ("operator", "runtime_image")

package_dir = {"phasefleet": "runtime_image/phasefleet"}
for root in ROOTS:
    for package in find_namespace_packages(
        root, include=["phasefleet.*"], exclude=["*.__pycache__"]
    ):
        package_dir[package] = f"{root}/{package.replace('.', '/')}"

setup(packages=sorted(package_dir), package_dir=package_dir)
