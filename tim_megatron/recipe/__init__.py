"""Typed recipes: schema, loading with inheritance and overrides, sweeps."""

from tim_megatron.recipe.loader import LoadedRecipe, RecipeError, load_recipe, recipe_to_yaml
from tim_megatron.recipe.schema import Recipe

__all__ = ["LoadedRecipe", "Recipe", "RecipeError", "load_recipe", "recipe_to_yaml"]
