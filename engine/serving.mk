# engine/serving.mk
