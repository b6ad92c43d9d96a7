"""Shared fixtures for every test level."""
