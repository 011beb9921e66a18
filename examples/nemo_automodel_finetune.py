"""NeMo Automodel's LLM fine-tuning recipe with its checkpoints saved in the background by asyncckpt.

The launcher NeMo ships (``nemo_automodel/recipes/llm/train_ft.py``), with one line changed:
the recipe class gets :class:`asyncckpt.integrations.nemo_automodel.AsyncckptRecipeMixin`.
Same YAML, same ``checkpoint:`` section (``checkpoint_dir``, ``restore_from``,
``max_recent_checkpoints``), same ``epoch_E_step_S`` folders and ``LATEST`` pointer::

    pip install 'asyncckpt[nemo-automodel]'
    torchrun --nproc-per-node=8 examples/nemo_automodel_finetune.py --config llama3_2_1b_squad.yaml
    # killed? run the same command again: it resumes from LATEST

NeMo's LLM recipe needs CUDA (its ``setup()`` builds the model on ``cuda``); the same
integration on CPU, with NeMo's ``BaseRecipe`` and a tiny model, is ``tests/support/_nemo_recipe_worker.py``.
"""

from __future__ import annotations

from nemo_automodel.components.config._arg_parser import parse_args_and_load_config
from nemo_automodel.recipes.llm.train_ft import TrainFinetuneRecipeForNextTokenPrediction

from asyncckpt.integrations.nemo_automodel import with_asyncckpt

# timeout: how long one save may take end to end before every rank raises SaveTimeoutError
Recipe = with_asyncckpt(TrainFinetuneRecipeForNextTokenPrediction, timeout=600.0)


def main() -> None:
    cfg = parse_args_and_load_config()  # --config FILE and NeMo's dotted overrides, as its own launcher
    recipe = Recipe(cfg)
    recipe.setup()  # resumes from checkpoint.restore_from, else from LATEST if there is one
    recipe.run_train_validation_loop()  # returns once the last save committed and LATEST names it


if __name__ == "__main__":
    main()
