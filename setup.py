"""Everything else is in setup.cfg. This adds what setup.cfg cannot say (its `packages = find:`
only finds folders under hf_asyncpp/): the top-level model_cards/, the card template users read and
edit, ships inside the package as hf_asyncpp/model_cards/, where hub.py finds it once installed."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["hf_asyncpp*"]), "hf_asyncpp.model_cards"],
      package_dir={"hf_asyncpp.model_cards": "model_cards"})
