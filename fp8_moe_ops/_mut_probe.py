from .reference import cdiv
