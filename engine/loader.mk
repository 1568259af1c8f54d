# engine/loader.mk: model config, safetensors, number formats, weights and the reference GEMV.
libdsv4engine_la_SOURCES += \
	engine/config.c engine/config.h \
	engine/safetensors.c engine/safetensors.h \
	engine/quant.c engine/quant.h \
	engine/weights.c engine/weights.h engine/linear.c
