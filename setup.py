"""Package discovery: every package under dcp_lens/ plus hooks/, which installs as dcp_lens.hooks.

pyproject.toml holds the rest of the metadata; `packages` is computed here because
setuptools' declarative `packages.find` cannot add a package that lives outside its tree.
"""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["dcp_lens", "dcp_lens.*"]), "dcp_lens.hooks"])
