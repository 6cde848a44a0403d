"""``python -m mindspeed_laga.launch pretrain_gpt.py ...``: the launcher's entry point.

The launcher itself lives with the MindSpeed feature it installs
(``mindspeed_laga.features.launch``); this module only keeps the command and
its names working.
"""
from mindspeed_laga.features.launch import (  # noqa: F401  (the launcher's public names)
    MANAGER_MODULE, USAGE, install_laga_feature, keep_laga_in_features_list, main, split_script)

if __name__ == "__main__":
    main()
