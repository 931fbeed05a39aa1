"""Recipes that build the shipped models. Not needed to run the app."""
