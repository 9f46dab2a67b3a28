/* csrc/hotpath/module.c: The module cupy_memstrat._hotpath: its types.
 * Part of the extension's one compilation unit: csrc/hotpath.c includes it. */

static struct PyModuleDef hotpath_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "cupy_memstrat._hotpath",
    .m_doc = PyDoc_STR("The allocation hot path of cupy_memstrat's strategies, in C (see csrc/hotpath.c)."),
    .m_size = -1,
};

PyMODINIT_FUNC
PyInit__hotpath(void)
{
    PyTypeObject *types[] = {&AccountingType, &GcSafeMallocType, &PoolDirectType, &PoolTokenType};
    const char *names[] = {"Accounting", "GcSafeMalloc", "PoolDirect", "PoolToken"};
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++)
        if (PyType_Ready(types[i]) < 0)
            return NULL;
    S_ptr = PyUnicode_InternFromString("ptr");
    S_mem = PyUnicode_InternFromString("mem");
    S_size = PyUnicode_InternFromString("size");
    S_device_id = PyUnicode_InternFromString("device_id");
    S_token = PyUnicode_InternFromString("_cupy_memstrat_block");
    if (S_ptr == NULL || S_mem == NULL || S_size == NULL || S_device_id == NULL || S_token == NULL)
        return NULL;
    PyObject *m = PyModule_Create(&hotpath_module);
    if (m == NULL)
        return NULL;
    for (size_t i = 0; i < sizeof(types) / sizeof(types[0]); i++) {
        Py_INCREF(types[i]);
        if (PyModule_AddObject(m, names[i], (PyObject *)types[i]) < 0) {
            Py_DECREF(types[i]);
            Py_DECREF(m);
            return NULL;
        }
    }
    return m;
}
