# engine/loader.mk
