# engine/cpu.mk
