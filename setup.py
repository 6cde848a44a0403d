"""The package layout; the metadata is in pyproject.toml.

The repository keeps the user's folder names (``features/``, ``patches/``) but
installs them under ``mindspeed_laga`` so no generic top-level name
(``features``, ``patches``) lands in site-packages. Subpackages are found, not
listed, so a new one needs no edit here.
"""
from setuptools import find_packages, setup

MAPPED = {"mindspeed_laga.features": "features", "mindspeed_laga.patches": "patches"}


def packages():
    found = find_packages(include=["mindspeed_laga", "mindspeed_laga.*"])
    for package, folder in MAPPED.items():
        found += [package] + [f"{package}.{sub}" for sub in find_packages(folder)]
    return found


setup(
    packages=packages(),
    package_dir={"mindspeed_laga": "mindspeed_laga", **MAPPED},
)
